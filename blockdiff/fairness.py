"""Per-client round robin: the one queue that the server's preprocessing pool and the structured
outputs' build pool take their work from, so that one client's many requests wait behind each
other's turns, not in front of everyone else's."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class RoundRobin(Generic[T]):
    """Items queued per client; `pop` takes the first item of the client whose turn it is and puts
    that client at the back. Not thread-safe: its owner holds its lock or runs on one loop."""

    def __init__(self, newcomers_first: bool = False):
        """newcomers_first: a client with nothing queued takes the next turn (the others have been
        served since it was) instead of the last."""
        self.newcomers_first = newcomers_first
        self._queues: OrderedDict[Hashable, deque[T]] = OrderedDict()

    def push(self, client: Hashable, item: T) -> None:
        queue = self._queues.get(client)
        if queue is None:
            queue = self._queues[client] = deque()
            if self.newcomers_first:
                self._queues.move_to_end(client, last=False)
        queue.append(item)

    def pop(self) -> T:
        """IndexError when nothing is queued."""
        if not self._queues:
            raise IndexError("pop from an empty RoundRobin")
        client, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        if queue:
            self._queues.move_to_end(client)
        else:
            del self._queues[client]
        return item

    def remove(self, client: Hashable, item: T) -> None:
        """Drop `item` if it is still queued."""
        queue = self._queues.get(client)
        if queue is not None and item in queue:
            queue.remove(item)
            if not queue:
                del self._queues[client]

    def drain(self) -> list[T]:
        """Every queued item, the queue left empty."""
        items = [item for queue in self._queues.values() for item in queue]
        self._queues.clear()
        return items

    def __bool__(self) -> bool:
        return bool(self._queues)
