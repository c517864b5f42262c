"""Admission and step planning: which requests run, and what each does this step.

Requests are admitted first-come first-served while a slot is free and the KV cache can hold
everything the request may ever commit. Every step, each running request contributes one row:
a prompt chunk (PREFILL), its finished canvas (COMMIT), or its canvas being denoised (DENOISE).
"""

from __future__ import annotations

from collections import deque

import torch

from blockdiff.diffusion.sampler import DenoiseParams
from blockdiff.engine.kv_cache import BlockAllocator
from blockdiff.engine.model_runner import StepOutput, StepPlan
from blockdiff.engine.request import Request, State
from blockdiff.model.attention import Row


class Scheduler:
    def __init__(self, num_slots: int, allocator: BlockAllocator, vocab_size: int, canvas_length: int, max_prefill_tokens: int):
        self.allocator = allocator
        self.vocab_size = vocab_size
        self.canvas_length = canvas_length
        self.max_prefill_tokens = max_prefill_tokens
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, request: Request) -> None:
        """Give back the slot and cache blocks of a request that finished or was aborted."""
        if request.slot is not None:  # admitted: it holds a slot until now
            self.running.remove(request)
            self.free_slots.append(request.slot)
            self.allocator.release(request.blocks)
            request.slot, request.blocks = None, ()
        else:
            self.waiting.remove(request)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if not self.allocator.can_allocate(req.max_cached_tokens):
                break
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.blocks = self.allocator.allocate(req.max_cached_tokens)
            req.state = State.PREFILL
            self.running.append(req)

    def schedule(self) -> tuple[StepPlan, list[Request], list[Request]] | None:
        """-> (plan, requests of the encoder rows, requests of the decoder rows), or None if idle."""
        self._admit()
        enc, dec = [], []
        enc_rows, dec_rows, enc_ids = [], [], []
        budget = self.max_prefill_tokens
        for req in self.running:
            if req.state == State.PREFILL:
                n = min(len(req.prompt_token_ids) - req.num_cached, budget)
                if n <= 0:
                    continue
                budget -= n
                enc_ids.extend(req.prompt_token_ids[req.num_cached : req.num_cached + n])
                enc_rows.append(Row(req.slot, req.num_cached, n, False, req.blocks))
                enc.append(req)
            elif req.state == State.COMMIT:
                enc_ids.extend(req.pending_commit)
                enc_rows.append(Row(req.slot, req.num_cached, len(req.pending_commit), False, req.blocks))
                enc.append(req)
            elif req.state == State.DENOISE:
                dec_rows.append(Row(req.slot, req.num_cached, self.canvas_length, True, req.blocks))
                dec.append(req)
        if not enc and not dec:
            return None

        new_rows, new_canvases, draws = [], [], []
        for i, req in enumerate(dec):
            if req.steps_left == 0:
                new_rows.append(i)
                new_canvases.append(req.initial_canvas(self.vocab_size))
                req.steps_left = req.params.max_denoising_steps
            draws.append(req.step_draws(self.vocab_size))
        denoise = None
        if dec:
            p = [r.params for r in dec]
            denoise = DenoiseParams(
                step=torch.tensor([r.steps_left for r in dec], dtype=torch.int32),
                max_steps=torch.tensor([x.max_denoising_steps for x in p], dtype=torch.int32),
                t_min=torch.tensor([x.t_min for x in p], dtype=torch.float32),
                t_max=torch.tensor([x.t_max for x in p], dtype=torch.float32),
                entropy_bound=torch.tensor([x.entropy_bound for x in p], dtype=torch.float32),
                stability=torch.tensor([x.stability_threshold for x in p], dtype=torch.long),
                confidence=torch.tensor([x.confidence_threshold for x in p], dtype=torch.float32),
                uniform=torch.stack([d[0] for d in draws]),
                renoise=torch.stack([d[1] for d in draws]),
            )
        top = max((r.params.logprobs for r in dec if r.params.logprobs is not None), default=-1)
        plan = StepPlan(
            rows=enc_rows + dec_rows,
            encoder_ids=torch.tensor(enc_ids, dtype=torch.long),
            new_canvas_rows=new_rows,
            new_canvases=torch.stack(new_canvases) if new_canvases else torch.empty(0, self.canvas_length, dtype=torch.long),
            denoise=denoise,
            top_logprobs=top,
        )
        return plan, enc, dec

    def advance_encoder(self, enc: list[Request], plan: StepPlan) -> None:
        for req, row in zip(enc, plan.rows):
            req.num_cached += row.length
            if req.state == State.COMMIT:
                req.pending_commit = None
                req.state = State.DENOISE
            elif req.num_cached == len(req.prompt_token_ids):
                req.state = State.DENOISE

    def advance_decoder(self, dec: list[Request], out: StepOutput) -> list[tuple[Request, int]]:
        """Count the step; -> the requests whose canvas is done, with their row index."""
        done = []
        for i, req in enumerate(dec):
            req.steps_left -= 1
            req.metrics.denoising_steps += 1
            req.metrics.canvas_positions_evaluated += self.canvas_length
            if req.params.stream_drafts:
                req.draft_token_ids = out.argmax[i].tolist()
            if bool(out.finished[i]):
                req.steps_left = 0
                done.append((req, i))
        return done
