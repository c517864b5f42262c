"""The engine: requests in, one step at a time, RequestOutputs out.

    add_request: InputProcessor -> Request -> Scheduler queue
    step:        Scheduler.schedule -> StepPlan -> executor.execute -> update_from_output -> outputs

With async scheduling, the executor runs each plan on the engine's step thread, one at a time and in
order: `step()` applies step n's results, starts step n+1, and only then makes step n's outputs,
which its caller delivers (and adds and aborts requests) while n+1 runs. Every change to the
engine's state happens on the caller's thread; the step thread only executes a plan. Without it,
`step()` runs its plan on the caller's thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from blockdiff.config import EngineConfig, parse_dtype
from blockdiff.diffusion.registry import make_sampler
from blockdiff.engine.block_allocator import BlockPool
from blockdiff.engine.client import EngineLimits, EngineStats
from blockdiff.engine.multimodal import MultiModalIntake
from blockdiff.engine.input_processor import InputProcessor
from blockdiff.engine.kv_cache_manager import KVCacheManager
from blockdiff.engine.kv_events import KVEvent, make_publisher
from blockdiff.engine.lora_request import LoRARequest
from blockdiff.engine.lora_slots import LoRASlots
from blockdiff.engine.output_processor import fail, make_output, update_from_output
from blockdiff.engine.request import Request
from blockdiff.engine.scheduler import Scheduler, SchedulerOutput
from blockdiff.engine.worker_record import WorkerRecord
from blockdiff.executor import make_executor
from blockdiff.inputs import EngineRequest
from blockdiff.model.registry import default_sampler, load_config
from blockdiff.outputs import RequestOutput
from blockdiff.parallel.ranks import WorkerError
from blockdiff.sampling_params import SamplingParams, generation_defaults
from blockdiff.step import ImageInputs, MinTokens, ScorePlan, StepPlan, StepRow, step_options
from blockdiff.structured.compiler import StructuredOutputs
from blockdiff.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        cfg.check_model()
        self.cfg = cfg
        self.model_config = load_config(cfg.model)
        if cfg.num_layers_override is not None:
            self.model_config = self.model_config.first_layers(cfg.num_layers_override)
        if cfg.canvas_length is not None:
            self.model_config = replace(self.model_config, canvas_length=cfg.canvas_length)
        self.tokenizer = Tokenizer.from_pretrained(cfg.tokenizer or cfg.model, cfg.chat_template)
        self.sampler = make_sampler(cfg.diffusion_sampler or default_sampler(self.model_config))
        source = {"auto": cfg.model, "vllm": None}.get(cfg.generation_config, cfg.generation_config)
        self.defaults = generation_defaults(source, self.sampler.fields)
        eos = generation_defaults(cfg.model, ()).get("eos_token_ids", self.model_config.eos_token_ids)
        self.canvas_length = self.model_config.canvas_length
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = cfg.max_model_len if cfg.max_model_len is not None else min(self.model_config.max_position_embeddings, 8192)
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.model_config.max_position_embeddings}"
            )
        # Steps are bounded so that one canvas cannot hold its slot indefinitely.
        self.max_denoising_steps = cfg.max_denoising_steps_limit or max(4 * self.canvas_length,
                                                                        self.defaults["max_denoising_steps"])
        self.executor = make_executor(cfg, self.model_config, parse_dtype(cfg.dtype, self.model_config, cfg.resolved_device()),
                                      cfg.resolved_device(), self.max_model_len, self.sampler.name)
        cache = self.executor.cache_config
        # A non-causal encoder's K/V of a token depend on the tokens after it in its chunk: nothing to share.
        caching = cfg.enable_prefix_caching and self.model_config.encoder_causal
        self.kv = KVCacheManager(BlockPool(cache.num_blocks, cache.block_size, caching),
                                 BlockPool(cache.sliding_blocks, cache.block_size, caching),
                                 self.model_config.window_past(self.max_model_len), cfg.prefix_cache_scope)
        self.scheduler = Scheduler(cache.num_slots, self.kv, cfg.max_prefill_tokens, cfg.preempt_after_canvases)
        self.lora = LoRASlots(cfg.max_loras, cfg.max_lora_rank, self.model_config.arch) if cfg.enable_lora else None
        self.scheduler.adapters = self.lora
        self.structured = None if self.tokenizer is None else StructuredOutputs(
            self.tokenizer, self.vocab_size, timeout=cfg.structured_outputs_timeout, memory=cfg.structured_outputs_memory,
            builds=cfg.structured_outputs_builds)
        self.sent = WorkerRecord()  # what the workers hold: per slot, and the automata
        self.inputs = InputProcessor(
            self.tokenizer, self.sampler, {**self.defaults, **cfg.sampling_defaults},
            tuple(eos),
            self.vocab_size, self.canvas_length, self.max_model_len, self.max_denoising_steps,
            # Replicas draw different seeds for the requests that bring none.
            cache.num_blocks * cache.block_size, cfg.seed + cfg.replica,
            MultiModalIntake.from_pretrained(cfg, self.model_config, self.tokenizer),
            self.structured,
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.last_step_time = 0.0
        self.async_scheduling = cfg.overlaps_steps(cfg.resolved_device())
        # One thread, so plans run in the order they were made; what it runs reads nothing the
        # caller's thread changes (a plan is self-contained, the runner's state is its own). It
        # starts on the CUDA device this thread is on, as the executor left it (rank 0's).
        cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="blockdiff-step",
                                               initializer=None if cuda is None else torch.cuda.set_device,
                                               initargs=() if cuda is None else (cuda,))
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        # Who gets the KV cache's block events after each step: the ZMQ publisher of
        # --kv-events-config, and whoever else subscribes (the data-parallel front end).
        self.kv_event_sinks: list[Callable[[list[KVEvent]], None]] = []
        try:
            self.kv_publisher = make_publisher(cfg.kv_events_config, cfg.replica)
        except BaseException:
            self.executor.shutdown()
            raise
        if self.kv_publisher is not None:
            self.kv_event_sinks.append(self.kv_publisher.publish)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    request_id: str | None = None, lora_request: LoRARequest | None = None) -> Request:
        """vLLM's call: `prompt` as `InputProcessor.request` takes it, `params` as the user gave them,
        `lora_request` the LoRA adapter it runs with; made into an EngineRequest here, and added."""
        return self.add(self.inputs.request(prompt, params, lora_request), request_id)

    def add(self, request: EngineRequest, request_id: str | None = None) -> Request:
        """Queue an engine request made at the edge; a LoRAError where its adapter cannot be served."""
        if request.adapter is not None:
            if self.lora is None:
                raise ValueError(f"request names the LoRA adapter {request.adapter.name!r}, but LoRA is not "
                                 "enabled (--enable-lora)")
            self.lora.check(request.adapter)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        req = self.inputs.process(request_id, request)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Also while a step that runs it is in flight: that step's results for it are dropped, and
        its blocks go back to the pool, which no plan takes from before that step has ended."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            req.finish("abort")
            self.scheduler.release(req)

    def reset_after_worker_loss(self) -> list[Request]:
        """The executor lost its workers and started new ones with an empty cache: every request that
        had started lost its state. Abort those (-> them); waiting ones keep their place in the queue."""
        lost = [req for req in self.requests.values() if req.slot is not None]
        for req in lost:
            self.abort(req.request_id)
        self.kv.forget()  # the prefixes the old workers held are gone too
        self._publish_kv_events()
        self.sent.forget()
        if self.lora is not None:
            self.lora.forget()
        return lost

    def has_unfinished(self) -> bool:
        """Requests are queued or running, or a step is in flight (whose end `step()` collects)."""
        return self.scheduler.has_work() or self._in_flight is not None

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over every running request; -> outputs of requests that committed a
        canvas, finished, or (with stream_drafts) have a new draft. A step that raises ends the
        requests it ran with finish_reason "error"; the others go on. The step's KV events go to
        the sinks before its outputs are returned."""
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        events = self.kv.take_events()
        if events:
            for sink in self.kv_event_sinks:
                sink(events)

    def _step(self) -> list[RequestOutput]:
        if self._in_flight is None and not self._launch():
            return []
        news = self._collect()
        if self.async_scheduling:
            self._launch()  # step n+1 runs while step n's outputs are made and delivered
        return self._outputs(news)

    def _launch(self) -> bool:
        """Schedule the next step and start it (on the step thread with async scheduling, else run it
        here); False if nothing can run."""
        sched = self.scheduler.schedule()
        if sched is None:
            return False
        plan = self._plan(sched)
        if self.async_scheduling:
            self._in_flight = (sched, self._step_thread.submit(self._execute, plan))
        else:  # run here and now: no thread to wake, twice a step
            self._in_flight = (sched, _run_now(self._execute, plan))
        return True

    def _execute(self, plan: StepPlan):
        t0 = time.perf_counter()
        try:
            return self.executor.execute(plan)
        finally:
            self.last_step_time = time.perf_counter() - t0

    def _collect(self) -> list[Request]:
        """Wait for the step in flight and apply its results; -> the requests with news."""
        sched, future = self._in_flight
        self._in_flight = None
        try:
            out = future.result()
        except WorkerError:  # a lost tensor-parallel worker stops the whole engine
            raise
        except Exception as e:
            ran = [r for r in list({r: None for r, _ in [*sched.encoder, *sched.score]}) + sched.decoder
                   if not r.finished]
            log.exception("an engine step failed; its %d requests end with an error", len(ran))
            fail(self.scheduler, ran, f"the engine step failed: {type(e).__name__}: {e}")
            if self.lora is not None:  # a slot it was to write may be empty now: each is written again
                self.lora.forget()
            return ran
        return update_from_output(self.scheduler, sched, out)

    def _plan(self, sched: SchedulerOutput) -> StepPlan:
        cl = self.canvas_length
        rows, ids = [], []
        images = _EncoderInputsOfStep()
        for req, n in sched.encoder:
            spans = images.add(req, req.num_cached, n, len(ids))
            bidirectional = spans if self.model_config.vision and self.model_config.vision.bidirectional else ()
            ids.extend(req.tokens(req.num_cached, req.num_cached + n))
            rows.append(StepRow(req.slot, n, False, bidirectional))
        score_ids, lengths = [], []
        for req, (start, end) in sched.score:
            rows.append(StepRow(req.slot, end - start, True))  # from the cached prompt before the piece
            score_ids.extend(req.tokens(start, end))
            lengths.append(end - start)
        score = None
        if sched.score:
            score = ScorePlan(torch.tensor(score_ids, dtype=torch.long), lengths,
                              max(r.params.prompt_logprobs for r, _ in sched.score))
        new_rows, new_canvases, started = [], [], []
        for i, req in enumerate(sched.decoder):
            rows.append(StepRow(req.slot, cl, True))
            if req.new_canvas is not None:
                new_rows.append(i)
                new_canvases.append(req.new_canvas)
                started.append(req)
                req.new_canvas = None
        min_tokens = _min_tokens(sched.decoder, cl)
        steps = self._steps_per_launch(sched, min_tokens is not None)
        denoise = step_options([r.params.options for r in sched.decoder]) if sched.decoder else None
        new_requests, tables = self.sent.slots([r for r, _ in sched.encoder] + [r for r, _ in sched.score] + sched.decoder)
        constraints = [req.constraint.canvas(i, req.params.max_tokens - len(req.output.token_ids))
                       for i, req in enumerate(sched.decoder) if req.constraint is not None]
        automata, forget = self.sent.automata([r.constraint.automaton for r in sched.decoder if r.constraint])
        return StepPlan(
            rows=rows,
            encoder_ids=torch.tensor(ids, dtype=torch.long),
            new_canvas_rows=new_rows,
            new_canvases=torch.stack(new_canvases) if new_canvases else torch.empty(0, cl, dtype=torch.long),
            denoise=denoise,
            top_logprobs=max((r.params.logprobs for r in sched.decoder if r.params.logprobs is not None), default=-1),
            draft_details=any(r.params.draft_details for r in sched.decoder),
            images=images.inputs(),
            score=score,
            min_tokens=min_tokens,
            tables=tables,
            new_requests=new_requests,
            new_canvas_steps=[r.steps_left for r in started],
            new_canvas_index=[r.metrics.canvases for r in started],
            steps=steps,
            constraints=constraints,
            automata=automata,
            forget_automata=forget,
            adapter_loads=self.lora.take_loads() if self.lora is not None else {},
        )

    def _steps_per_launch(self, sched: SchedulerOutput, min_tokens: bool) -> int:
        """K steps back to back in the steady state (every row a canvas, nobody reading a step's own
        results: logprobs, reported from the step's own distribution (VocabParallel.reported),
        drafts, min_tokens rules, a structured output's commit; no request a free slot could
        admit), at most as many as the canvases have steps left (more would compute finished ones
        only); else one."""
        k, dec = self.executor.steps_per_launch, sched.decoder
        if k == 1 or sched.encoder or sched.score or not dec or (self.scheduler.waiting and self.scheduler.free_slots):
            return 1
        if min_tokens or any(r.params.stream_drafts or r.params.draft_details or r.params.logprobs is not None
                             or r.constraint is not None or r.params.denoising_mode == "fast" for r in dec):
            return 1
        return min(k, max(r.steps_left for r in dec))

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in requests:
            if req.finished:
                self.requests.pop(req.request_id, None)
            out = make_output(req)
            if out is not None:
                outputs.append(out)
        return outputs

    # ---- introspection ---------------------------------------------------------------------
    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.cfg.model, self.max_model_len, self.cfg.max_num_seqs,
                            self.max_denoising_steps, self.canvas_length, self.vocab_size)

    def stats(self) -> EngineStats:
        return EngineStats(self.num_running, self.num_waiting, self.num_free_slots, self.kv_cache_usage,
                           self.kv.full.num_blocks, self.kv.queries, self.kv.hits, self.scheduler.num_preemptions,
                           self.kv.block_size, self.kv.full.caching, self.kv.full.num_free, self.kv.scope,
                           *self._lora_stats())

    def _lora_stats(self) -> tuple:
        """(running adapters, waiting adapters, adapter slots) for vllm:lora_requests_info."""
        if self.lora is None:
            return (), (), 0
        running = sorted({r.adapter.name for r in self.scheduler.running if r.adapter is not None})
        waiting = sorted({r.adapter.name for r in self.scheduler.waiting if r.adapter is not None})
        return tuple(running), tuple(waiting), len(self.lora.held)

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
        return self.kv.usage

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.close()  # no build outlives the engine
        if self.kv_publisher is not None:
            self.kv_publisher.shutdown()
        # The executor first: a step in flight that waits on a lost worker fails once the workers are gone.
        self.executor.shutdown()
        self._step_thread.shutdown(wait=True)


def _run_now(fn: Callable, *args) -> Future:
    """fn(*args) run on this thread, as a done future."""
    future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as e:
        future.set_exception(e)
    return future


def _min_tokens(decoder: list[Request], canvas_length: int) -> MinTokens | None:
    """The canvases of this step that may not commit a stop token in their first positions yet."""
    rules = []
    for req in decoder:
        before = min(canvas_length, req.params.min_tokens - len(req.output.token_ids))
        rules.append((sorted(req.output.stop_token_ids), max(0, before)))
    if not any(before for _, before in rules):
        return None
    width = max(1, max(len(ids) for ids, _ in rules))
    banned = torch.full((len(rules), width), -1, dtype=torch.long)
    for i, (ids, _) in enumerate(rules):
        banned[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return MinTokens(banned, torch.tensor([before for _, before in rules], dtype=torch.long))


class _EncoderInputsOfStep:
    """The runs of soft tokens (an image, a video frame) that fall in this step's prompt chunks,
    gathered as ImageInputs: the vision tower encodes each run as an image."""

    def __init__(self):
        self.pixels, self.positions, self.rows, self.index = [], [], [], []
        self.features = 0  # soft tokens of the images taken so far

    def add(self, req: Request, start: int, n: int, token_offset: int) -> tuple[tuple[int, int], ...]:
        """Take the runs of req's chunk [start, start + n) whose tokens sit from `token_offset` on in
        the packed encoder tokens; -> their spans within the chunk."""
        spans = []
        for run in req.placeholders:
            a, b = run.start, run.end
            lo, hi = max(a, start), min(b, start + n)
            if lo >= hi:
                continue
            self.pixels.append(run.pixel_values)
            self.positions.append(run.position_ids)
            self.rows.append(torch.arange(self.features + lo - a, self.features + hi - a))
            self.index.append(torch.arange(token_offset + lo - start, token_offset + hi - start))
            self.features += b - a
            spans.append((lo, hi))
        return tuple(spans)

    def inputs(self) -> ImageInputs | None:
        if not self.pixels:
            return None
        return ImageInputs(self.pixels, self.positions, torch.cat(self.rows), torch.cat(self.index))
