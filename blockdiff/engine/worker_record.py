"""The host's one record of what the workers were sent, and the rule that keeps it true.

The workers own the per-slot state of the requests they run: each rank keeps, per slot, where the
request's next row starts (its cached length), its sampler parameters with the denoising counter n,
its block tables (worker/request_slots.py, worker/block_tables.py), and the token automata of
structured outputs by key. The engine sends each piece once and then only what changed:

- a request that takes a slot (another request held it, or the same one before a preemption) is
  sent whole: its cached length and sampler parameters (`step.NewRequests`; with penalties or a
  logit bias, its prompt and the output committed so far too), its tables cleared and
  written; within one admission its tables only grow (a sliding entry given back keeps its old id
  on the workers, out of every query's reach), so a step sends the entries past those sent;
- an automaton goes with the first step that needs it, and the least recently used beyond
  `WORKER_AUTOMATA` are dropped again (sent anew if needed later).

The invariant: after a step, the workers advance positions and n themselves from what every plan
says anyway (an encoder row adds its length to its slot's position; a canvas that starts sets n,
`StepPlan.new_canvas_steps`; each denoising step run counts n down), and the host's copies,
`Request.num_cached` and `Request.steps_left`, advance by the same rule from the same plans
(`Request.cached`, `Request.stepped`): the host predicts, it never asks. This module is the only
place that decides what a plan carries of that state. A lost worker's replacement starts empty
(`forget`).
"""

from __future__ import annotations

from collections import OrderedDict

from blockdiff.engine.request import Request
from blockdiff.step import Automaton, NewRequests, TableDelta

WORKER_AUTOMATA = 32


class WorkerRecord:
    def __init__(self, automata_limit: int = WORKER_AUTOMATA):
        self.automata_limit = automata_limit
        self._slots: dict[int, tuple[Request, int, int, int]] = {}  # slot -> (request, admission, full, sliding)
        self._automata: OrderedDict[str, None] = OrderedDict()  # keys the workers hold, least recent first

    def slots(self, requests: list[Request]) -> tuple[NewRequests | None, TableDelta | None]:
        """What brings the workers' slots of `requests` (the rows of one step) up to date: the requests
        that took their slot since the workers last heard (None: none), with their sampler inputs as
        the edge resolved them, and the tables' changes (None: none)."""
        taken, full, sliding = [], [], []
        for req in dict.fromkeys(requests):
            admission = req.metrics.preemptions
            sent = self._slots.get(req.slot)
            if sent is None or sent[0] is not req or sent[1] != admission:
                taken.append(req)
                sent_full = sent_sliding = 0
            else:
                sent_full, sent_sliding = sent[2], sent[3]
            full += [(req.slot, i, b) for i, b in enumerate(req.blocks[sent_full:], sent_full)]
            sliding += [(req.slot, i, b) for i, b in enumerate(req.sliding_blocks[sent_sliding:], sent_sliding)]
            self._slots[req.slot] = (req, admission, len(req.blocks), len(req.sliding_blocks))
        adapters = [r.adapter_slot for r in taken]
        penalties = [r.penalties() for r in taken]
        new = NewRequests([r.slot for r in taken], [r.num_cached for r in taken], [r.seed for r in taken],
                          [r.steps_left for r in taken], [r.metrics.canvases for r in taken],
                          [r.params.per_canvas for r in taken], adapters if any(a >= 0 for a in adapters) else None,
                          penalties if any(p is not None for p in penalties) else None) if taken else None
        if not (taken or full or sliding):
            return new, None
        return new, TableDelta.of([r.slot for r in taken], full, sliding)

    def automata(self, needed: list[Automaton]) -> tuple[dict[str, Automaton], tuple[str, ...]]:
        """The automata a step needs -> (those to send with it, the keys the workers may drop)."""
        send = {}
        for a in needed:
            if a.key in self._automata:
                self._automata.move_to_end(a.key)
            else:
                send[a.key] = a
                self._automata[a.key] = None
        wanted = {a.key for a in needed}
        forget = []
        for key in list(self._automata):
            if len(self._automata) <= self.automata_limit:
                break
            if key not in wanted:
                del self._automata[key]
                forget.append(key)
        return send, tuple(forget)

    def forget(self) -> None:
        """The workers are new: they hold nothing."""
        self._slots.clear()
        self._automata.clear()
