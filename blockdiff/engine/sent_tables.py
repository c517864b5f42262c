"""What the workers' block tables hold, as far as the engine told them: for each slot, the request
(and its admission) whose table it is and how many entries of each kind went out.

Within one admission a request's tables only grow (a sliding entry given back keeps its old id on
the workers, out of every query's reach), so the change of a step is the entries past those sent;
a slot another request took, or the same request readmitted, is cleared and sent whole once.
"""

from __future__ import annotations

from blockdiff.engine.request import Request
from blockdiff.step import TableDelta


class SentTables:
    def __init__(self):
        self._sent: dict[int, tuple[Request, int, int, int]] = {}  # slot -> (request, admission, full, sliding)

    def delta(self, requests: list[Request]) -> TableDelta | None:
        """The changes that bring the tables of `requests` (the rows of one step) up to date; None: none."""
        reset, full, sliding = [], [], []
        for req in dict.fromkeys(requests):
            admission = req.metrics.preemptions
            sent = self._sent.get(req.slot)
            if sent is None or sent[0] is not req or sent[1] != admission:
                reset.append(req.slot)
                sent_full = sent_sliding = 0
            else:
                sent_full, sent_sliding = sent[2], sent[3]
            full += [(req.slot, i, b) for i, b in enumerate(req.blocks[sent_full:], sent_full)]
            sliding += [(req.slot, i, b) for i, b in enumerate(req.sliding_blocks[sent_sliding:], sent_sliding)]
            self._sent[req.slot] = (req, admission, len(req.blocks), len(req.sliding_blocks))
        if not (reset or full or sliding):
            return None
        return TableDelta.of(reset, full, sliding)

    def forget(self) -> None:
        """The workers are new: their tables are empty."""
        self._sent.clear()
