"""Which requests run this step, and on what resources. The scheduler owns the queues, the slots
and the cache blocks; it changes a request only to admit or preempt it.

Admission is first-come first-served while a slot is free and the KV cache can hold everything the
request may ever commit. Every step each running request contributes one row: its uncached tokens
(PREFILL: a prompt chunk, at most `max_prefill_tokens` per step across requests; COMMIT: its
finished canvas) or its canvas being denoised (DENOISE).

Fairness: when the request at the head of the queue cannot be admitted, running requests that have
committed `preempt_after` canvases since their admission give up their slot and blocks at their
canvas boundary (COMMIT), oldest admission first, and go to the back of the queue; they are
recomputed from their tokens when readmitted. A waiting request therefore starts within one canvas
of some running request: at most the engine's denoising-steps limit plus a commit step, once the
running requests have had `preempt_after` canvases each.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from blockdiff.engine.block_allocator import BlockAllocator
from blockdiff.engine.request import Request, State


@dataclass
class SchedulerOutput:
    encoder: list[tuple[Request, int]]  # requests with uncached tokens, and how many run this step
    decoder: list[Request]  # requests whose canvas is denoised this step
    preempted: list[Request]


class Scheduler:
    def __init__(self, num_slots: int, allocator: BlockAllocator, max_prefill_tokens: int, preempt_after: int | None):
        self.allocator = allocator
        self.max_prefill_tokens = max_prefill_tokens
        self.preempt_after = preempt_after
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in order of admission

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, request: Request) -> None:
        """Give back the slot and cache blocks of a request that finished or was aborted."""
        if request.slot is not None:  # admitted: it holds a slot until now
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _free(self, request: Request) -> None:
        self.free_slots.append(request.slot)
        self.allocator.release(request.blocks)

    def _admit(self) -> None:
        while self.waiting and self.free_slots and self.allocator.can_allocate(self.waiting[0].max_cached_tokens):
            req = self.waiting.popleft()
            req.admit(self.free_slots.pop(), self.allocator.allocate(req.max_cached_tokens))
            self.running.append(req)

    def _preempt_for_waiting(self) -> list[Request]:
        """Make room for the head of the queue from requests at a canvas boundary that had their share."""
        preempted = []
        if self.preempt_after is None:
            return preempted
        for req in list(self.running):
            head = self.waiting[0] if self.waiting else None
            if head is None or (self.free_slots and self.allocator.can_allocate(head.max_cached_tokens)):
                break
            if req.state != State.COMMIT or req.canvases_since_admitted < self.preempt_after:
                continue
            self.running.remove(req)
            self._free(req)
            req.preempt()
            self.waiting.append(req)
            preempted.append(req)
        return preempted

    def schedule(self) -> SchedulerOutput | None:
        """-> this step's requests, or None if nothing can run."""
        self._admit()
        preempted = self._preempt_for_waiting()
        if preempted:
            self._admit()
        encoder, decoder = [], []
        budget = self.max_prefill_tokens
        for req in self.running:
            if req.state == State.DENOISE:
                decoder.append(req)
            elif req.state == State.COMMIT:
                encoder.append((req, req.num_tokens - req.num_cached))
            elif req.state == State.PREFILL:
                n = min(req.num_tokens - req.num_cached, budget)
                if n > 0:
                    budget -= n
                    encoder.append((req, n))
        if not encoder and not decoder:
            return None
        return SchedulerOutput(encoder, decoder, preempted)
