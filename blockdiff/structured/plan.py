"""Which token automata the workers hold: each is sent once, with the first step that needs it,
and the least recently used beyond `limit` are dropped again (sent anew if needed later)."""

from __future__ import annotations

from collections import OrderedDict

from blockdiff.step import Automaton

WORKER_AUTOMATA = 32


class AutomataSent:
    def __init__(self, limit: int = WORKER_AUTOMATA):
        self.limit = limit
        self._held: OrderedDict[str, None] = OrderedDict()

    def update(self, needed: list[Automaton]) -> tuple[dict[str, Automaton], tuple[str, ...]]:
        """The automata a step needs -> (those to send with it, the keys the workers may drop)."""
        send = {}
        for a in needed:
            if a.key in self._held:
                self._held.move_to_end(a.key)
            else:
                send[a.key] = a
                self._held[a.key] = None
        wanted = {a.key for a in needed}
        forget = []
        for key in list(self._held):
            if len(self._held) <= self.limit:
                break
            if key not in wanted:
                del self._held[key]
                forget.append(key)
        return send, tuple(forget)
