"""What the workers keep per slot, as far as the engine told them: for each slot, the request (and
its admission) that holds it there, and how many entries of each block table went out.

A request that takes a slot (another request held it, or the same one before a preemption) is sent
whole once: its cached length and sampler parameters (`step.NewRequests`, built by the engine), its
tables cleared and written. After that the workers advance positions and steps themselves, and
within one admission a request's tables only grow (a sliding entry given back keeps its old id on
the workers, out of every query's reach), so the change of a step is the entries past those sent.
"""

from __future__ import annotations

from blockdiff.engine.request import Request
from blockdiff.step import TableDelta


class SentSlots:
    def __init__(self):
        self._sent: dict[int, tuple[Request, int, int, int]] = {}  # slot -> (request, admission, full, sliding)

    def delta(self, requests: list[Request]) -> tuple[list[Request], TableDelta | None]:
        """What brings the workers' slots of `requests` (the rows of one step) up to date: the
        requests that took their slot since the workers last heard, and the tables' changes (None: none)."""
        taken, full, sliding = [], [], []
        for req in dict.fromkeys(requests):
            admission = req.metrics.preemptions
            sent = self._sent.get(req.slot)
            if sent is None or sent[0] is not req or sent[1] != admission:
                taken.append(req)
                sent_full = sent_sliding = 0
            else:
                sent_full, sent_sliding = sent[2], sent[3]
            full += [(req.slot, i, b) for i, b in enumerate(req.blocks[sent_full:], sent_full)]
            sliding += [(req.slot, i, b) for i, b in enumerate(req.sliding_blocks[sent_sliding:], sent_sliding)]
            self._sent[req.slot] = (req, admission, len(req.blocks), len(req.sliding_blocks))
        if not (taken or full or sliding):
            return taken, None
        return taken, TableDelta.of([r.slot for r in taken], full, sliding)

    def forget(self) -> None:
        """The workers are new: they hold nothing."""
        self._sent.clear()
