"""Which replica a request goes to: the one that caches the longest prefix of it, else the least
loaded. `ReplicaRouting` is the routing of a remote engine client's replicas whatever carries the
requests and the events (remote_client.py): the data-parallel front end over processes
(dp_client.py) and the Ray Serve request router over Ray's handles route by it.

Each replica's `PrefixIndex` holds the keys of the full blocks it reported stored and not removed
since (its KV events, kv_events.py), plus the keys of the requests routed to it that have not ended:
a burst of requests with one prefix follows the first of them before its prefill has stored
anything. A request's blocks are keyed the way the replica keys them (block_allocator.block_keys),
so a match is a prefix the replica can hit, not a guess from the text.

Affinity yields to load: among the replicas with no more than `imbalance` requests above the least
loaded, the longest match wins (the least loaded of those that tie); with no match there, the least
loaded. Load is the requests a replica has in progress, then its free KV blocks; replicas equal in
both take turns. The default imbalance, a quarter of a replica's batch, keeps most of the hits while
a shared prefix does not pile a burst onto one replica (docs/benchmarks.md, "Data parallelism":
with a whole batch of slack, 81% of prompt tokens hit but a burst queued on one replica while the
other idled, 6.8 requests/s; with a quarter, 76% and 13.7 requests/s, on a loaded machine).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from blockdiff.engine.block_allocator import block_keys, key_root
from blockdiff.engine.kv_events import external_hash
from blockdiff.inputs import EngineRequest


class PrefixIndex:
    """The block keys one replica caches, from its KV events, and those its requests will store."""

    def __init__(self):
        self.stored: set[Hashable] = set()
        self.pending: Counter[Hashable] = Counter()

    def stored_blocks(self, keys: Sequence[Hashable]) -> None:
        self.stored.update(keys)

    def removed_blocks(self, keys: Sequence[Hashable]) -> None:
        self.stored.difference_update(keys)

    def cleared(self) -> None:
        self.stored.clear()

    def expect(self, keys: Sequence[Hashable]) -> None:
        """A request with these block keys was routed here."""
        self.pending.update(keys)

    def done(self, keys: Sequence[Hashable]) -> None:
        """...and has ended: its blocks are stored (their events came first) or never will be."""
        self.pending.subtract(keys)
        for key in keys:
            if self.pending[key] <= 0:
                del self.pending[key]

    def match(self, keys: Sequence[Hashable]) -> int:
        """The leading blocks of `keys` this replica caches or is about to."""
        n = 0
        for key in keys:
            if key not in self.stored and key not in self.pending:
                break
            n += 1
        return n


@dataclass
class Candidate:
    name: Hashable
    load: int  # requests in progress
    free_blocks: int
    index: PrefixIndex | None = None  # None: nothing known of its cache


def default_imbalance(max_num_seqs: int) -> int:
    return max(1, max_num_seqs // 4)


class PrefixRouter:
    def __init__(self, imbalance: int):
        self.imbalance = imbalance
        self._turns = itertools.count(1)
        self._last: dict[Hashable, int] = {}  # when each replica was last chosen

    def choose(self, candidates: list[Candidate], keys: Sequence[Hashable]) -> tuple[Candidate, int]:
        """-> (the replica for a request whose full blocks have `keys`, the blocks it matched)."""
        if not candidates:
            raise ValueError("no replica to route to")
        least = min(c.load for c in candidates)
        near = [c for c in candidates if c.load <= least + self.imbalance]
        matches = {id(c): (c.index.match(keys) if c.index is not None and keys else 0) for c in near}
        best = max(matches.values())
        pool = [c for c in near if matches[id(c)] == best] if best > 0 else [c for c in candidates if c.load == least]
        chosen = min(pool, key=lambda c: (c.load, -c.free_blocks, self._last.get(c.name, 0)))
        self._last[chosen.name] = next(self._turns)
        return chosen, best


def prompt_block_keys(request: EngineRequest, block_size: int, scope: str) -> tuple[int, ...]:
    """The hashes of the request's full prompt blocks, as its replica publishes them in its KV events
    (the engine's keys under its block_allocator.key_root, which `scope` chooses, read as
    kv_events.external_hash)."""
    root = key_root(request.params.cache_salt, request.client, scope)
    return tuple(external_hash(k) for k in block_keys(request.prompt.keyed(), block_size, root))


class ReplicaRouting:
    """What a front end knows of its replicas' caches, and the policy that routes by it: one
    PrefixIndex per replica, fed with the (tag, block hashes) of its KV events as they come (from
    the replica's process, or off its ZMQ socket) and with the requests routed to it until they end."""

    def __init__(self, imbalance: int):
        self.policy = PrefixRouter(imbalance)
        self.indexes: dict[Hashable, PrefixIndex] = {}

    def index(self, name: Hashable) -> PrefixIndex:
        return self.indexes.setdefault(name, PrefixIndex())

    def events(self, name: Hashable, events: Iterable[tuple[str, Sequence[int]]]) -> None:
        index = self.index(name)
        for kind, hashes in events:
            if kind == "BlockStored":
                index.stored_blocks(hashes)
            elif kind == "BlockRemoved":
                index.removed_blocks(hashes)
            elif kind == "AllBlocksCleared":
                index.cleared()

    def choose(self, replicas: Sequence[tuple[Hashable, int, int]], keys: Sequence[int]) -> Hashable:
        """-> the replica for a request with these block hashes, of `replicas` as (name, requests in
        progress, free KV blocks); a replica that reported no events yet counts as caching nothing."""
        candidates = [Candidate(name, load, free, self.indexes.get(name)) for name, load, free in replicas]
        return self.policy.choose(candidates, keys)[0].name

    def routed(self, name: Hashable, keys: Sequence[int]) -> None:
        """A request with these block hashes went to `name` (what Ray or the front end chose)."""
        self.index(name).expect(keys)

    def ended(self, name: Hashable, keys: Sequence[int]) -> None:
        self.index(name).done(keys)

    def forget(self, name: Hashable) -> None:
        """`name` is gone (or restarts with an empty cache)."""
        self.indexes.pop(name, None)
