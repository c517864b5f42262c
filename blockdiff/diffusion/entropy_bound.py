"""The entropy-bound sampler with self-conditioning: DiffusionGemma's own (the reference's).

For each canvas, with n counting down from max_denoising_steps to 1:
  temperature t = t_min + (t_max - t_min) * n / N; processed logits = logits / t;
  candidates drawn from softmax(processed); the argmax canvas kept aside;
  the lowest-entropy positions are accepted while Σentropy - entropy_of_last <= entropy_bound,
  the others renoised to uniform random tokens;
  the canvas is done when the argmax canvas equals the previous `stability_threshold` ones and
  the mean entropy is below `confidence_threshold`, or when the steps run out;
  a finished canvas commits its argmax canvas; the next step's self-conditioning input is the soft
  embedding of this step's processed distribution.
The distribution is computed once (`VocabParallel.distribution`) and everything else derives from it.
top_k, top_p and min_p (vLLM's order: min-p, top-k, then top-p) restrict the candidate draw only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from blockdiff.diffusion import randoms
from blockdiff.diffusion.strategy import DiffusionSampler, SlotState, StepParams, StepResult, start, step_words
from blockdiff.diffusion.vocab_parallel import Distribution, ReferenceKernels, VocabParallel
from blockdiff.sampling_params import (FIELDS_BY_NAME, MAX_TEMPERATURE, MIN_TEMPERATURE, SAMPLER_FIELDS, InvalidParam,
                                       SamplingParams, within)
from blockdiff.step import step_options

# Request temperature 0 asks for greedy decoding: the schedule is scaled by this instead, since the
# sampler divides by the temperature.
GREEDY_SCALE = 1e-6


@dataclass
class DenoiseParams(StepParams):
    """Per-canvas parameters of one step, [canvases]: the step count n and the counters of the
    step's random numbers (StepParams), and one tensor per per-canvas field of the sampler-field
    table, by its name and in its order (tests/engine/test_engine_core.py checks it)."""

    max_denoising_steps: torch.Tensor  # int32
    entropy_bound: torch.Tensor
    t_min: torch.Tensor
    t_max: torch.Tensor
    stability_threshold: torch.Tensor  # int32
    confidence_threshold: torch.Tensor
    top_k: torch.Tensor  # int32
    top_p: torch.Tensor
    min_p: torch.Tensor
    settle_steps: torch.Tensor  # int32; 0: the canvas runs in the exact mode
    settle_entropy: torch.Tensor
    # Whether any canvas sets top_k, top_p or min_p: decided on the host when the step is planned,
    # so that a step without them never pays for their search.
    restrict: bool = False
    # Whether any canvas runs in the fast mode: a step without one runs the exact step's operations only.
    fast: bool = False


@dataclass
class EntropyBoundState(SlotState):
    last_argmax: torch.Tensor = start(-1)  # [slots + 1, CL] int64: the previous step's argmax canvas
    run: torch.Tensor = start(0)  # [slots + 1] int64: how many previous argmax canvases equal it
    soft: torch.Tensor = start(0)  # [slots + 1, CL, hidden]: the self-conditioning input
    # The fast mode's (module docstring, "Fast mode"); an exact canvas leaves them at their start.
    held: torch.Tensor = start(0)  # [slots + 1, CL] int64: steps each position's argmax has held
    settled: torch.Tensor = start(False)  # [slots + 1, CL] bool: final, no longer renoised nor computed
    kept_entropy: torch.Tensor = start(0)  # [slots + 1, CL] float32: a settled position's entropy at settling
    kept_logprob: torch.Tensor = start(0)  # [slots + 1, CL] float32: its token's logprob then


def denoise_params(step: list[int], params: list, seeds: list[int], canvases: list[int] | None = None) -> DenoiseParams:
    """The sampler's inputs for canvases at steps `step` of requests with resolved SamplingParams
    `params` and `seeds`, at canvas indices `canvases` (default: their first), with their step's options."""
    sampler = EntropyBound()
    out = sampler.step_params(step, [sampler.canvas_values(p) for p in params], seeds, canvases or [0] * len(step))
    return out.with_options(step_options([sampler.request_options(p) for p in params]))


@dataclass
class DenoiseResult:
    canvas: torch.Tensor  # [canvases, CL] the next step's input
    argmax: torch.Tensor  # [canvases, CL] the committed canvas if this step ends the canvas
    entropy: torch.Tensor  # [canvases, CL]
    accepted: torch.Tensor  # [canvases, CL] bool
    run: torch.Tensor  # [canvases] how many previous argmax canvases equal this one
    finished: torch.Tensor  # [canvases] bool
    dist: Distribution


def temperature(step: torch.Tensor, max_steps: torch.Tensor, t_min: torch.Tensor, t_max: torch.Tensor) -> torch.Tensor:
    """The reference's float32 arithmetic: t_min + (t_max - t_min) * (n / N)."""
    return t_min + (t_max - t_min) * (step.float() / max_steps.float())


def min_temperature(t_min: float, t_max: float, steps: int) -> float:
    """The schedule's lowest temperature (its last step, n = 1), in the sampler's float32."""
    f = np.float32
    return float(f(t_min) + (f(t_max) - f(t_min)) * (f(1) / f(steps)))


def entropy_bound_accept(entropy: torch.Tensor, bound: torch.Tensor, kernels: ReferenceKernels | None = None) -> torch.Tensor:
    """Accept the longest lowest-entropy prefix with Σentropy - max entropy <= bound; `kernels`: the
    sampler backend whose running sum adds the entropies (None: the reference)."""
    sorted_entropy, order = torch.sort(entropy, dim=-1)
    keep = ((kernels or ReferenceKernels()).cumsum(sorted_entropy) - sorted_entropy) <= bound.unsqueeze(-1)
    # back to position order through the inverse permutation: a gather, not a scatter
    return keep.gather(-1, torch.sort(order, dim=-1).indices)


def _draw(logits: torch.Tensor, params: DenoiseParams, vocab: VocabParallel):
    """A step's distribution at its temperature, its argmax and sampled candidates, and the tokens
    that renoise the positions not accepted; -> (dist, argmax, candidates, renoise)."""
    t = temperature(params.step, params.max_denoising_steps, params.t_min, params.t_max)
    words = step_words(params, logits.shape[1])
    uniform, renoise = randoms.uniform(words[0]), randoms.below(words[1], vocab.shard.vocab_size)
    dist = vocab.distribution(logits, t[:, None, None])
    # top-k, top-p and min-p narrow the candidates only: the argmax, the entropies that accept
    # candidates and stop the canvas, and the self-conditioning input keep the full distribution.
    draw = vocab.restricted_draw(dist, params.top_k, params.top_p, params.min_p) if params.restrict else None
    argmax, candidates = vocab.argmax_and_sample(dist, uniform, draw)
    return dist, argmax, candidates, renoise


def denoise_step(
    logits: torch.Tensor,
    last_argmax: torch.Tensor,
    run: torch.Tensor,
    params: DenoiseParams,
    vocab: VocabParallel,
) -> DenoiseResult:
    """logits [canvases, CL, local vocab] float32 (overwritten)."""
    dist, argmax, candidates, renoise = _draw(logits, params, vocab)
    accepted = entropy_bound_accept(dist.entropy, params.entropy_bound, vocab.kernels)
    canvas = torch.where(accepted, candidates, renoise)
    same = (argmax == last_argmax).all(dim=-1)
    run = torch.where(same, run + 1, torch.zeros_like(run))
    stable = run >= params.stability_threshold
    # A threshold of 0 never stops a canvas: a mean entropy that rounds to or below 0 is not "confident".
    confident = (params.confidence_threshold > 0) & (dist.entropy.mean(dim=-1) < params.confidence_threshold)
    finished = (stable & confident) | (params.step <= 1)
    return DenoiseResult(canvas, argmax, dist.entropy, accepted, run, finished, dist)


class EntropyBound(DiffusionSampler):
    """The entropy-bound sampler (module docstring) as the strategy the engine runs."""

    name = "entropy_bound"
    fields = SAMPLER_FIELDS
    self_conditioning = True
    params_type = DenoiseParams

    def after_resolve(self, resolved: SamplingParams, given: SamplingParams) -> SamplingParams:
        """The request temperature applied to the schedule, and the schedule checked as a whole."""
        out = resolved
        if out.temperature is not None:
            # The request temperature scales the denoising schedule (t_min .. t_max); 0 is greedy.
            scale = out.temperature or GREEDY_SCALE
            scaled = {"t_min": out.t_min * scale, "t_max": out.t_max * scale}
            for name, value in scaled.items():
                if not within(FIELDS_BY_NAME[name], value):
                    raise InvalidParam("temperature", f"temperature {given.temperature} scales {name} to {value!r}, "
                                                      f"outside [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
            out = replace(out, **scaled, temperature=None)
        if out.denoising_mode == "fast" and _reads_the_last_distribution(out):
            out = replace(out, denoising_mode="exact")
        lowest = min_temperature(out.t_min, out.t_max, out.max_denoising_steps)
        if not lowest >= MIN_TEMPERATURE:
            who = "temperature" if given.temperature is not None else "t_min"
            raise InvalidParam(who, f"{who}: the denoising temperature falls to {lowest:.3g} at the last step "
                                    f"(t_min={out.t_min}, t_max={out.t_max}, {out.max_denoising_steps} steps); it must "
                                    f"stay >= {MIN_TEMPERATURE}")
        return out

    def canvas_values(self, params: SamplingParams) -> dict[str, int | float]:
        """The table's per-canvas values; an exact canvas's settle_steps is 0 (it never settles)."""
        values = super().canvas_values(params)
        if params.denoising_mode != "fast":
            values["settle_steps"] = 0
        return values

    def request_options(self, params: SamplingParams) -> dict[str, bool]:
        """Whether the request restricts its draw (top_k, top_p, min_p), and whether it runs fast."""
        return {"restrict": params.top_k > 0 or params.top_p < 1 or params.min_p > 0,
                "fast": params.denoising_mode == "fast"}

    def new_state(self, rows: int, canvas_length: int, hidden_size: int, dtype: torch.dtype,
                  device: torch.device) -> EntropyBoundState:
        with torch.device(device):
            return EntropyBoundState(
                canvas=torch.zeros(rows, canvas_length, dtype=torch.long),
                last_argmax=torch.full((rows, canvas_length), -1, dtype=torch.long),
                run=torch.zeros(rows, dtype=torch.long),
                soft=torch.zeros(rows, canvas_length, hidden_size, dtype=dtype),
                held=torch.zeros(rows, canvas_length, dtype=torch.long),
                settled=torch.zeros(rows, canvas_length, dtype=torch.bool),
                kept_entropy=torch.zeros(rows, canvas_length, dtype=torch.float32),
                kept_logprob=torch.zeros(rows, canvas_length, dtype=torch.float32),
            )

    def step(self, logits: torch.Tensor, state: EntropyBoundState, slots: torch.Tensor, params: DenoiseParams,
             vocab: VocabParallel) -> StepResult:
        last_argmax, run = state.last_argmax.index_select(0, slots), state.run.index_select(0, slots)
        if params.fast:
            return fast_step(logits, state, slots, last_argmax, run, params, vocab)
        res = denoise_step(logits, last_argmax, run, params, vocab)
        return StepResult(updates={"canvas": res.canvas, "last_argmax": res.argmax, "run": res.run}, tokens=res.argmax,
                          logprob=-res.dist.log_total, accepted=res.accepted, finished=res.finished, dist=res.dist)


def _reads_the_last_distribution(params: SamplingParams) -> bool:
    """Whether what a request's canvas commits is read from the whole distribution of the step that
    ends it (structured outputs and vocabulary restrictions, min_tokens, top logprobs): a fast step
    has none for its settled positions, so such a request runs in the exact mode."""
    return (params.structured_outputs is not None or params.allowed_token_ids is not None or bool(params.bad_words)
            or params.min_tokens > 0 or (params.logprobs or 0) > 0)


def fast_step(logits: torch.Tensor, state: EntropyBoundState, slots: torch.Tensor, last_argmax: torch.Tensor,
              run: torch.Tensor, params: DenoiseParams, vocab: VocabParallel) -> StepResult:
    """One step of canvases some of which run in the fast mode (settle_steps > 0; the others' rows
    come out as `denoise_step`'s). A position settled before this step was not computed (its logits
    rows are filler): it keeps its argmax, entropy and logprob, and its input stays its argmax."""
    settled = state.settled.index_select(0, slots)
    held = state.held.index_select(0, slots)
    dist, argmax, candidates, renoise = _draw(logits, params, vocab)
    argmax = torch.where(settled, last_argmax, argmax)
    entropy = torch.where(settled, state.kept_entropy.index_select(0, slots), dist.entropy)
    logprob = torch.where(settled, state.kept_logprob.index_select(0, slots), -dist.log_total)
    # Settled positions take part in the acceptance as they did when they settled (their entropy
    # uses the bound's budget), and are never renoised.
    accepted = entropy_bound_accept(entropy, params.entropy_bound, vocab.kernels) | settled
    held = torch.where(argmax == last_argmax, held + 1, torch.zeros_like(held))
    fast = params.settle_steps > 0
    now = settled | (fast[:, None] & (held >= params.settle_steps[:, None])
                     & (entropy < params.settle_entropy[:, None]))
    canvas = torch.where(now, argmax, torch.where(accepted, candidates, renoise))
    same = (argmax == last_argmax).all(dim=-1)
    run = torch.where(same, run + 1, torch.zeros_like(run))
    stable = run >= params.stability_threshold
    # A settled position is final: it counts as certain for the stop, not at the entropy it settled
    # with, which no later step lowers (it is not computed again): counted so, positions that settled
    # under settle_entropy but above confidence_threshold would hold the canvas's mean above it.
    unsure = torch.where(now, torch.zeros_like(entropy), entropy)
    confident = (params.confidence_threshold > 0) & (unsure.mean(dim=-1) < params.confidence_threshold)
    finished = (stable & confident) | (params.step <= 1) | (fast & now.all(dim=-1))
    updates = {"canvas": canvas, "last_argmax": argmax, "run": run, "held": held, "settled": now,
               "kept_entropy": entropy, "kept_logprob": logprob}
    return StepResult(updates=updates, tokens=argmax, logprob=logprob, accepted=accepted, finished=finished,
                      dist=replace(dist, entropy=entropy), frozen=settled)
