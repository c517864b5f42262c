"""Which replica a request goes to: the one that caches the longest prefix of it, else the least
loaded. The data-parallel front end (dp_client.py) and the Ray Serve request router
(entrypoints/ray_serve.py) route by it.

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
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


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

    def reset(self) -> None:
        self.stored.clear()
        self.pending.clear()


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
