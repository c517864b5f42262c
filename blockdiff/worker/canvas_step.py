"""The steady-state denoising step as one static function: forward, sampler and self-conditioning
product over a bucket of canvases, with no host sync and no Python loop over rows.

When every row of a step is a canvas being denoised, the step's shape is fixed by the number of
canvases (padded up to a bucket) and the prefix length its attention reads (padded up to a power
of two of blocks). Its one input, the canvases' slots, is copied into a persistent device buffer of
that shape; the function reads the per-slot state, the rank's block tables (worker/block_tables.py),
positions and sampler parameters (worker/request_slots.py) at those slots, computes everything for
every canvas, padded ones included, and hands back fresh tensors that the runner scatters into the state. So `torch.compile(fullgraph=True)`
accepts it, and on CUDA each shape is captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from blockdiff.diffusion.strategy import DiffusionSampler, SlotState, StepParams
from blockdiff.diffusion.vocab_parallel import Distribution, VocabParallel
from blockdiff.model.attention import CacheGeometry, Row, canvas_metadata
from blockdiff.model.interface import BlockDiffusionModel, StepAdapters
from blockdiff.worker.penalties import SlotPenalties
from blockdiff.worker.request_slots import RequestSlots

BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket(n: int) -> int:
    """Canvases padded up to 1, 2, 4, ..., 32, then to a multiple of 32."""
    return next((b for b in BUCKETS if b >= n), -(-n // BUCKETS[-1]) * BUCKETS[-1])


@dataclass
class CanvasInputs:
    """Persistent device buffers of one shape: what a step of canvases reads besides the per-slot
    state (the scratch slot's: position 0, the sampler fields' defaults)."""

    slots: torch.Tensor  # [B] int64; padding: the scratch slot


@dataclass
class CanvasOutputs:
    updates: dict[str, torch.Tensor]  # [B, ...] the canvases' new state rows, self-conditioning included
    tokens: torch.Tensor  # [B, CL] what each canvas commits if this step finished it
    finished: torch.Tensor  # [B] bool
    logprob: torch.Tensor  # [B, CL] of each token
    entropy: torch.Tensor  # [B, CL] computed anyway; read back only for drafts that ask (draft_details)
    accepted: torch.Tensor  # [B, CL] bool
    # The distribution statistics of the last step run, which a constrained commit reads (a step
    # with a constrained canvas runs one denoising step: engine._steps_per_launch).
    dist: Distribution
    steps: torch.Tensor  # [B] int32 denoising steps each canvas ran (up to the one that finished it)

    def head(self, n: int) -> "CanvasOutputs":
        """The first `n` canvases' outputs (a padded bucket's real ones); `dist` as it is."""
        return CanvasOutputs({k: v[:n] for k, v in self.updates.items()},
                             *(getattr(self, k)[:n] for k in _RESULTS), self.dist, self.steps[:n])


def canvas_step(
    model: BlockDiffusionModel,
    sampler: DiffusionSampler,
    vocab: VocabParallel,
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    geometry: CacheGeometry,
    tables: dict[bool, torch.Tensor],
    context: int,
    state: SlotState,
    positions: torch.Tensor,
    slot_params: StepParams,
    inputs: CanvasInputs,
    steps: int = 1,
    logits: torch.Tensor | None = None,
    adapters: StepAdapters | None = None,
    adapter_level: int = 0,
    penalties: SlotPenalties | None = None,
) -> CanvasOutputs:
    """`steps` denoising steps of every canvas in `inputs`, back to back; reads `state`, `kv`, the
    block `tables` (layer kind -> [slots + 1, blocks per sequence]), the slots' `positions`
    [slots + 1] (cached lengths) and `slot_params` (the sampler's [slots + 1] rows, with the step's
    options), writes none of them. `logits`: a float32 buffer of at least [canvases * CL, local
    vocab] that the model writes the logits into (the outputs' `dist` then views it), or None for
    fresh ones. `adapters`: the model's adapters where its layers take them, whose mapping is set
    here at `adapter_level` (StepAdapters.level) from the slots' adapters. `penalties`: the slots' penalties and
    logit biases where one of the canvases has some, else None. A canvas
    that finishes at one of the steps keeps its state and its results from that step on (the later
    steps still compute it, masked), so its results are those of one step at a time."""
    rows = inputs.slots.shape[0]
    cl = state.canvas.shape[1]
    mine = {sliding: table.index_select(0, inputs.slots) for sliding, table in tables.items()}
    meta = canvas_metadata(positions.index_select(0, inputs.slots), mine, cl, context, geometry)
    first = slot_params.select(inputs.slots)
    work = state.rows(inputs.slots)  # the canvases' state through the steps
    here = torch.arange(rows, device=inputs.slots.device)
    if adapters is not None:  # every token of a canvas takes its slot's adapter
        index = adapters.table.index_select(0, inputs.slots).unsqueeze(1).expand(rows, cl).reshape(-1)
        adapters.set(index if adapter_level else None, meta, adapter_level == 2)
    out = None
    for i in range(steps):
        params = first if i == 0 else first.later(i)
        if out is not None:
            # Nothing reads the previous step's distribution again: dropped before this step's
            # forward, its logits [canvases, CL, local vocab] are freed before this step's are made,
            # and a launch holds one step's logits at a time, not two.
            out.dist = None
        out = _then(out, forward_step(model, sampler, vocab, kv, meta, work, here, params, logits_out=logits,
                                      penalties=penalties, penalty_slots=inputs.slots)[1])
        # The next step's state is these rows, in order: taken as they are, not copied into the working
        # copy in place, which inductor's CPU loop fusion mishandles when the next step's norms read it back
        # (KeyError 'buf444' in try_outer_loop_fusion_with_local_buf, torch 2.13).
        work = replace(work, **out.updates)
    return out


_RESULTS = ("tokens", "finished", "logprob", "entropy", "accepted")


def _then(out: CanvasOutputs | None, now: CanvasOutputs) -> CanvasOutputs:
    """The outputs of the steps so far (`out`, None before the first) followed by those of the step
    just run: a canvas that had finished keeps what it had, the distribution is the new step's."""
    if out is None:
        return now
    done = out.finished  # before this step: they keep what they had
    return CanvasOutputs({k: _where(done, out.updates[k], v) for k, v in now.updates.items()},
                         *(_where(done, getattr(out, k), getattr(now, k)) for k in _RESULTS),
                         now.dist, out.steps + (~done).to(torch.int32))


def _where(keep: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return torch.where(keep.view(-1, *([1] * (new.dim() - 1))), old, new)


def forward_step(model, sampler: DiffusionSampler, vocab: VocabParallel, kv, meta, state: SlotState,
                 slots: torch.Tensor, params: StepParams | None, prefix: torch.Tensor | None = None, scored: int = 0,
                 images=None, logits_out: torch.Tensor | None = None,
                 penalties: SlotPenalties | None = None,
                 penalty_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, CanvasOutputs | None]:
    """The one step function, eager and static alike: a forward over [prefix: encoder tokens, then
    `scored` decoder tokens | the canvases of `slots`], then the sampler. -> (the scored tokens' logits,
    the canvases' outputs or None). A starting canvas's soft embeddings are zeros: the reference's first step.
    With `meta.active` (the fast mode) only its active decoder rows run; the others' logits are zeros,
    which the sampler does not read (it keeps a settled position's results)."""
    rows, cl = slots.shape[0], state.canvas.shape[1]
    ids = state.canvas.index_select(0, slots).reshape(-1)
    soft = state.soft.index_select(0, slots).flatten(0, 1) if sampler.self_conditioning else None
    if prefix is not None:
        ids = torch.cat((prefix, ids))
        if soft is not None and scored:  # a scored piece is a canvas's first step: zeros
            soft = torch.cat((soft.new_zeros(scored, soft.shape[-1]), soft))
    active = meta.active
    if active is not None:
        ne = meta.num_encoder_tokens
        ids = torch.cat((ids[:ne], ids[ne:].index_select(0, active.index)))
        soft = None if soft is None else soft.index_select(0, active.index)
    if meta.num_tokens > ids.shape[0]:  # rows aligned for batch invariance (model/attention.py)
        ids = torch.cat((ids, ids.new_zeros(meta.num_tokens - ids.shape[0])))
    if logits_out is None and active is None and ids.device.type == "cpu" and not torch.compiler.is_compiling():
        # The logits are made first, before the forward's small tensors: in a heap that keeps freed memory
        # (worker/cpu_heap.py) they then take the block the step before freed, which those tensors would
        # otherwise split (a float32 generate grew by 1.88x its logits, not 0.88x: docs/benchmarks.md).
        # Compiled, inductor plans the step's memory itself (made here, they took more: 3.42x, not 2.89-3.13x).
        logits_out = torch.empty(scored + rows * cl, vocab.shard.local_rows, dtype=torch.float32, device=ids.device)
    logits = model(ids, meta, kv, soft, images, logits_out=None if logits_out is None else logits_out[: scored + rows * cl])
    if active is not None:
        logits = logits.new_zeros(scored + rows * cl, logits.shape[1]).index_copy_(0, active.index, logits)
    if rows == 0:
        return logits[:scored], None
    canvases = logits[scored:].view(rows, cl, -1)
    if penalties is not None:
        penalties.apply(canvases, slots if penalty_slots is None else penalty_slots, vocab)
    res = sampler.step(canvases, state, slots, params, vocab)
    updates = dict(res.updates)
    if sampler.self_conditioning:
        updates["soft"] = vocab.soft_embed(res.dist, None, model.soft_embed, model.dtype)
        if res.frozen is not None:  # a settled position's row stays its last distribution's
            updates["soft"] = torch.where(res.frozen[..., None], state.soft.index_select(0, slots), updates["soft"])
    return logits[:scored], CanvasOutputs(updates, sampler.commit(res, params), res.finished, res.logprob,
                                          res.dist.entropy, res.accepted, res.dist,
                                          torch.ones(rows, dtype=torch.int32, device=slots.device))


def shape_count(num_slots: int, max_context: int, block_size: int) -> int:
    """How many (bucket, context, restrict) shapes a step of canvases can take: every bucket up to
    that of `num_slots` canvases, every context up to `max_context` positions, with and without
    top-k/p sampling. The compiled step is allowed exactly this many graphs."""
    buckets = len({bucket(n) for n in range(1, num_slots + 1)})
    contexts = 1 + (max(1, -(-max_context // block_size)) - 1).bit_length() + 1  # 0, then 1, 2, 4, ... blocks
    return buckets * contexts * 2


# Each shape compiles to its own static-shape graph (what a CUDA graph replays anyway): no symbolic
# sizes, whose guards and generic kernels buy nothing when the shapes are a small known set.
COMPILE_OPTIONS = dict(fullgraph=True, dynamic=False)


def all_canvases(rows: list[Row]) -> bool:
    return bool(rows) and all(r.decoder for r in rows)


def context_of(rows: list[Row], block_size: int) -> int:
    """The prefix keys a step reads: the longest cached prefix, rounded up to a power of two of blocks."""
    blocks = -(-max(r.start for r in rows) // block_size)
    return 0 if blocks == 0 else (1 << (blocks - 1).bit_length()) * block_size


def host_inputs(rows: list[Row], size: int, scratch: int) -> CanvasInputs:
    """The step's inputs on the host, padded to `size` canvases."""
    return CanvasInputs(torch.tensor([r.slot for r in rows] + [scratch] * (size - len(rows)), dtype=torch.long))


def allocate_inputs(like: CanvasInputs, device: torch.device) -> CanvasInputs:
    """Device buffers shaped like `like`."""
    return CanvasInputs(torch.empty_like(like.slots, device=device))


def copy_inputs(dst: CanvasInputs, src: CanvasInputs) -> None:
    dst.slots.copy_(src.slots, non_blocking=True)


class CanvasSteps:
    """Runs `canvas_step` for the shapes the engine meets: eagerly, compiled with
    `torch.compile(fullgraph=True)`, and on CUDA (cuda_graphs) captured once per shape as a CUDA
    graph and replayed. Each shape keeps its input buffers, so a graph reads them where it was
    captured."""

    def __init__(self, model: BlockDiffusionModel, sampler: DiffusionSampler, vocab: VocabParallel,
                 kv: list[tuple[torch.Tensor, torch.Tensor]], geometry: CacheGeometry, tables: dict[bool, torch.Tensor],
                 state: SlotState, requests: RequestSlots, device: torch.device, compile: bool, cuda_graphs: bool,
                 steps_per_launch: int = 1, penalties: SlotPenalties | None = None,
                 adapters: StepAdapters | None = None):
        """tables: the rank's block tables (BlockTables.tables), and requests its per-slot positions
        and sampler parameters, read where they are at every step.
        steps_per_launch: the most steps one launch runs (EngineConfig.num_scheduler_steps): each
        shape has a graph for each number of steps up to it. penalties: the rank's per-slot
        penalties and logit biases (worker/penalties.py): a step with some has graphs of its own.
        adapters: the model's per-request adapters, where its layers take them (None: none)."""
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model, self.sampler, self.vocab, self.kv, self.geometry, self.tables = model, sampler, vocab, kv, geometry, tables
        self.state, self.requests, self.device, self.penalties = state, requests, device, penalties
        self.adapters = adapters
        self.fn = torch.compile(canvas_step, **COMPILE_OPTIONS) if compile else canvas_step
        # dynamo's recompile limit (8 by default) raised to the shapes this engine can meet, for
        # these calls only; a shape beyond them would be a bug and still fails.
        context = max(k.shape[0] for k, _ in kv) if kv else 0
        self.limits = dict(recompile_limit=steps_per_launch * shape_count(state.scratch, context, geometry.block_size)
                           * (3 if adapters is not None else 1)  # steps with no adapter, with some, on the experts too
                           * (2 if penalties is not None else 1))  # with and without penalties
        self.limits["accumulated_recompile_limit"] = max(torch._dynamo.config.accumulated_recompile_limit,
                                                         2 * self.limits["recompile_limit"])
        self.pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        # A captured graph keeps its outputs, the logits among them (the outputs' `dist` views
        # them): every graph writes one buffer, sized for the largest bucket, instead of each
        # holding [its canvases, CL, vocabulary] floats of its own (GBs each at Gemma's vocabulary).
        self.logits = None
        if cuda_graphs:
            most = bucket(state.scratch) * state.canvas.shape[1]
            self.logits = torch.empty(most, vocab.shard.local_rows, dtype=torch.float32, device=device)
        self.shapes: dict[tuple, tuple[CanvasInputs, torch.cuda.CUDAGraph | None, CanvasOutputs | None]] = {}

    def __call__(self, rows: list[Row], options: dict, steps: int = 1) -> tuple[CanvasInputs, CanvasOutputs]:
        """`steps` steps of the canvases `rows` (their state reset already where a canvas starts)
        with the sampler's step `options` (StepParams.options): the inputs used (padded) and the
        outputs, whose first len(rows) rows are the canvases'."""
        context = context_of(rows, self.geometry.block_size)
        size = bucket(len(rows))
        host = host_inputs(rows, size, self.state.scratch)
        # the options (e.g. restrict: top-k/p, min-p), the steps per launch and whether a canvas has a
        # adapter (StepAdapters.level): a graph each
        level = self.adapters.level(rows) if self.adapters is not None else 0
        penalized = self.penalties is not None and self.penalties.of([r.slot for r in rows]) is not None
        key = (size, context, tuple(options.items()), steps, penalized) + ((level,) if self.adapters is not None else ())
        if key not in self.shapes:
            self.shapes[key] = (allocate_inputs(host, self.device), None, None)
        inputs, graph, outputs = self.shapes[key]
        copy_inputs(inputs, host)
        if self.pool is None:
            with torch._dynamo.config.patch(**self.limits):
                return inputs, self.fn(*self.step_args(context, inputs, options, steps, level, penalized))
        if graph is None:
            with torch._dynamo.config.patch(**self.limits):
                graph, outputs = self._capture(self.step_args(context, inputs, options, steps, level, penalized))
            self.shapes[key] = (inputs, graph, outputs)
        graph.replay()
        return inputs, outputs

    def step_args(self, context: int, inputs: CanvasInputs, options: dict, steps: int = 1, level: int = 0,
                  penalized: bool = False) -> tuple:
        """canvas_step's arguments for `steps` steps of `inputs` reading `context` prefix positions,
        with the sampler's step `options`, with the slots' adapters at `level` (StepAdapters.level),
        and with their penalties where `penalized`."""
        return (self.model, self.sampler, self.vocab, self.kv, self.geometry, self.tables, context, self.state,
                self.requests.starts, self.requests.params.with_options(options), inputs, steps, self.logits,
                self.adapters, level, self.penalties if penalized else None)

    def _capture(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, CanvasOutputs]:
        # Compiled and warmed up on a side stream first (the step writes nothing, so running it is harmless).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: with async scheduling the engine's thread goes on while this one captures
        # (it makes no CUDA call then, but a capture must not depend on that).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.fn(*args)
        return graph, outputs
