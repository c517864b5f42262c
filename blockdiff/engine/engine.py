"""The engine: requests in, one step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import os
import random
import time
from dataclasses import dataclass

import torch

from blockdiff.config import ModelConfig, parse_dtype
from blockdiff.engine.kv_cache import BlockAllocator, CacheConfig, cache_bytes_per_block, ring_bytes_per_slot, ring_size
from blockdiff.engine.model_runner import StepPlan
from blockdiff.engine.request import Request, State
from blockdiff.engine.scheduler import Scheduler
from blockdiff.outputs import RequestOutput, TokenLogprob
from blockdiff.sampling_params import SamplingParams, generation_defaults
from blockdiff.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 16
    max_model_len: int | None = None
    kv_cache_memory: int | None = None  # bytes for full-attention blocks; None: enough for max_num_seqs at max_model_len
    block_size: int = 16
    max_prefill_tokens: int = 2048
    seed: int = 0
    tokenizer: str | None = None  # tokenizer directory; None: the model's
    chat_template: str | None = None  # overrides the tokenizer's

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        if not os.path.isdir(cfg.model):
            raise ValueError(f"model {cfg.model!r} is not a checkpoint directory")
        for name in ("max_num_seqs", "block_size", "max_prefill_tokens", "tensor_parallel_size", "max_model_len"):
            value = getattr(cfg, name)
            if name == "max_model_len" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.cfg = cfg
        self.model_config = ModelConfig.from_pretrained(cfg.model)
        self.tokenizer = Tokenizer.from_pretrained(cfg.tokenizer or cfg.model, cfg.chat_template)
        self.defaults = generation_defaults(cfg.model)
        self.eos_token_ids = tuple(self.defaults.get("eos_token_ids", self.model_config.eos_token_ids))
        self.canvas_length = self.model_config.canvas_length
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = cfg.max_model_len if cfg.max_model_len is not None else min(self.model_config.max_position_embeddings, 8192)
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.model_config.max_position_embeddings}"
            )
        dtype = parse_dtype(cfg.dtype, self.model_config)
        device = cfg.resolved_device()
        # Seeds of requests that bring none: reproducible from the engine seed, in arrival order.
        self._seeds = random.Random(cfg.seed)

        from blockdiff.parallel.executor import make_executor

        self.executor = make_executor(cfg, self.model_config, dtype, device, self._cache_config)
        self.cache = self.executor.cache_config
        self.allocator = BlockAllocator(self.cache.num_blocks, self.cache.block_size)
        self.scheduler = Scheduler(
            self.cache.num_slots, self.allocator, self.vocab_size, self.canvas_length, cfg.max_prefill_tokens
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_step_time = 0.0
        self.last_plan: StepPlan | None = None  # what the last step ran, None if nothing (benchmarks count its work)

    def _cache_config(self, model) -> CacheConfig:
        """Sized on a built (rank's) model, so per-rank head counts are right."""
        per_block = cache_bytes_per_block(model, self.cfg.block_size)
        rings = ring_bytes_per_slot(model, ring_size(model, self.max_model_len))
        if self.cfg.kv_cache_memory is None:
            num_blocks = self.cfg.max_num_seqs * -(-self.max_model_len // self.cfg.block_size)
        else:
            budget = self.cfg.kv_cache_memory - rings * self.cfg.max_num_seqs
            if per_block == 0:
                num_blocks = 1
            elif budget < per_block:
                raise ValueError(
                    f"kv_cache_memory {self.cfg.kv_cache_memory} bytes is too small: the sliding-window rings of "
                    f"{self.cfg.max_num_seqs} sequences take {rings * self.cfg.max_num_seqs} and one block {per_block}"
                )
            else:
                num_blocks = budget // per_block
        return CacheConfig(self.cfg.max_num_seqs, max(1, num_blocks), self.cfg.block_size, self.max_model_len)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        params = (params or SamplingParams()).with_defaults(self.defaults)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass the prompt as a list of token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        need = len(ids) + params.max_tokens
        if need > self.max_model_len:  # before the per-token checks, which a huge list would make slow
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds "
                f"max_model_len={self.max_model_len}"
            )
        self._check_tokens("prompt", ids)
        for name in ("draft", "stop_token_ids"):
            self._check_tokens(name, getattr(params, name) or [])
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer, and this checkpoint has none: use stop_token_ids")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        req = Request(request_id, text, ids, params, self.eos_token_ids, self.canvas_length, seed)
        if self.allocator.blocks_for(req.max_cached_tokens) > self.allocator.num_blocks:
            raise ValueError(
                f"request needs {req.max_cached_tokens} cached tokens, more than the whole KV cache "
                f"({self.allocator.num_blocks * self.allocator.block_size})"
            )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _check_tokens(self, name: str, ids: list) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}")

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            req.state = State.ABORTED
            req.finish_reason = "abort"
            self.scheduler.release(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over every running request; -> outputs of requests that committed a
        canvas, finished, or (with stream_drafts) have a new draft."""
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            self.last_plan = None
            return []
        plan, enc, dec = scheduled
        t0 = time.perf_counter()
        out = self.executor.execute(plan)
        self.last_step_time = time.perf_counter() - t0
        self.last_plan = plan
        self.scheduler.advance_encoder(enc, plan)
        outputs = []
        if not dec:
            return outputs
        done = self.scheduler.advance_decoder(dec, out)
        done_ids = set()
        for req, row in done:
            self._commit_canvas(req, out, row)
            done_ids.add(req.request_id)
            outputs.append(self.output(req))
        outputs += [self.output(r) for r in dec if r.params.stream_drafts and r.request_id not in done_ids]
        return outputs

    def _commit_canvas(self, req: Request, out, row: int) -> None:
        canvas = out.argmax[row].tolist()
        m = req.metrics
        m.canvases += 1
        if m.first_canvas_time is None:
            m.first_canvas_time = time.monotonic()
        if req.logprobs is not None:
            k = req.params.logprobs
            tops = [{} for _ in canvas]
            if out.top_ids is not None and k:
                tops = [dict(zip(i, lp)) for i, lp in zip(out.top_ids[row, :, :k].tolist(), out.top_logprobs[row, :, :k].tolist())]
            req.logprobs.extend(TokenLogprob(t, lp, top) for t, lp, top in zip(canvas, out.logprob[row].tolist(), tops))
        committed = len(req.output_token_ids)
        req.output_token_ids.extend(canvas)
        reason = self._stop_reason(req, committed)
        m.committed_tokens = len(req.output_token_ids)
        if reason is not None:
            req.finish_reason = reason
            req.state = State.FINISHED
            m.finished_time = time.monotonic()
            self.scheduler.release(req)
            self.requests.pop(req.request_id, None)
        else:
            req.pending_commit = canvas
            req.state = State.COMMIT

    def _stop_reason(self, req: Request, committed: int) -> str | None:
        """Trim the output at the first stop condition; -> "stop", "length" or None (go on).
        The first `committed` tokens passed this check at earlier canvases."""
        p = req.params
        ids = req.output_token_ids
        reason = None
        if len(ids) >= p.max_tokens:
            del ids[p.max_tokens :]
            reason = "length"
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops.update(req.eos_token_ids)
        cut = next((i for i, t in enumerate(ids) if t in stops), None)
        if cut is not None:
            del ids[cut + 1 :]
            reason = "stop"
        # As in vLLM, a stop token stays in token_ids but its text is left out of the output text.
        req.ends_with_stop_token = cut is not None
        if p.stop:
            text = self.tokenizer.decode(ids)
            ends = [text.find(s) + len(s) for s in p.stop if s in text]
            if ends:
                # Keep the fewest tokens whose text reaches the end of the first stop string; it ends
                # in this canvas, since the tokens before it held none.
                end = min(ends)
                n = next(n for n in range(committed + 1, len(ids) + 1) if len(self.tokenizer.decode(ids[:n])) >= end)
                del ids[n:]
                reason = "stop"
                req.ends_with_stop_token = False
        if req.logprobs is not None:
            del req.logprobs[len(ids) :]
        return reason

    def output(self, req: Request) -> RequestOutput:
        ids = list(req.output_token_ids)
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids[:-1] if req.ends_with_stop_token else ids)
            if req.finish_reason == "stop" and req.params.stop:
                hits = [text.find(s) for s in req.params.stop if s in text]
                if hits:
                    text = text[: min(hits)]
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            text=text,
            token_ids=ids,
            finish_reason=req.finish_reason,
            finished=req.finished,
            metrics=req.metrics.as_dict(),
            logprobs=list(req.logprobs) if req.logprobs is not None else None,
            draft_token_ids=req.draft_token_ids,
        )

    # ---- introspection ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self.scheduler.free_slots)

    @property
    def kv_cache_usage(self) -> float:
        return self.allocator.used / max(1, self.allocator.num_blocks)

    def shutdown(self) -> None:
        self.executor.shutdown()
