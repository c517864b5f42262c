"""A diffusion sampler: how a model's canvases are denoised, as one strategy object.

An architecture brings its sampler (model/registry.py names it; `EngineConfig.diffusion_sampler`
chooses another that the model can run), as vLLM's models bring their model state and SGLang's
dLLMs their `DllmAlgorithm`. A sampler owns:

- its field table (`fields`): what SamplingParams, the API's extra body and the CLI's sampler flags
  offer for a model that runs it, and how a request's values are resolved (`resolve`);
- how a canvas starts (`start_canvas`) and which random numbers a step draws: counter-based ones
  (diffusion/randoms.py), keyed by the request's seed and counted by (canvas, step, position), made
  inside the step on the device, so nothing is drawn on the host;
- its per-canvas inputs: resolved once at the edge into plain values (`canvas_values`, and the step
  options a request raises, `request_options`) that the engine carries untouched; each rank makes
  them `StepParams` (`step_params`) when a request takes a slot and keeps them per slot
  (`params_table`); a step's options travel with each plan. And its per-slot device state
  (`SlotState`, made by `new_state` on every rank);
- `step()`: one denoising step of a batch of canvases on one rank, from their logits over this
  rank's vocabulary rows, through `VocabParallel` (collectives under tensor parallelism, none on one
  rank); and `commit()`, what a finished canvas commits (structured outputs constrain it after the
  step: diffusion/constrained.py).

A sampler with `self_conditioning` reads its state's `soft` rows as the model's self-conditioning
input; the runner fills them from the step's distribution through the model's `soft_embed`.
The same `step()` runs in the eager runner and in the static canvas step (worker/canvas_step.py),
where it is traced whole by torch.compile: no host sync, no data-dependent Python control flow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from blockdiff.config import LOGPROBS_MODES
from blockdiff.diffusion import randoms
from blockdiff.diffusion.vocab_parallel import Distribution, VocabParallel
from blockdiff.step import StepParams
from blockdiff.sampling_params import (INT32_MAX, SAMPLER_FIELDS, InvalidParam, SamplerField, SamplingParams, check_field,
                                       field_value, with_field_values)


def step_words(params: StepParams, canvas_length: int) -> tuple[torch.Tensor, ...]:
    """A step's four random 32-bit words per canvas position [canvases, CL] (randoms.STEP): the
    same for a request alone, in any batch, after a preemption and on every rank."""
    return randoms.canvas_words(params.seed, params.canvas, params.step, randoms.STEP, canvas_length)


def start(value) -> dataclasses.Field:
    """A SlotState field and the value its rows take when a canvas starts."""
    return field(metadata={"start": value})


@dataclass
class SlotState:
    """A sampler's per-slot device state: one row per slot and one more, the last (the scratch
    slot), that takes the writes of padded canvases. `canvas` is the model's input; every other
    field is the sampler's and is reset to its `start` value when a canvas starts."""

    canvas: torch.Tensor  # [slots + 1, CL] int64

    @property
    def scratch(self) -> int:
        return self.canvas.shape[0] - 1

    def start(self, slots: torch.Tensor, canvases: torch.Tensor) -> None:
        """Canvases start in `slots` from the tokens `canvases` [len(slots), CL]."""
        self.canvas[slots] = canvases
        for f in dataclasses.fields(self):
            if "start" in f.metadata:
                getattr(self, f.name)[slots] = f.metadata["start"]

    def rows(self, slots: torch.Tensor) -> "SlotState":
        """The rows of `slots` as a state of their own (the working copy of several steps in one launch)."""
        return type(self)(**{f.name: getattr(self, f.name).index_select(0, slots) for f in dataclasses.fields(self)})

    def put(self, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Write the rows of `slots` (the tensors of a step's `StepResult.updates`)."""
        for name, value in rows.items():
            getattr(self, name).index_copy_(0, slots, value)


@dataclass
class StepResult:
    """What one denoising step of a batch of canvases produced, on every rank alike."""

    updates: dict[str, torch.Tensor]  # the canvases' new rows of the state fields the step changes
    tokens: torch.Tensor  # [canvases, CL] what each canvas commits if this step finishes it
    logprob: torch.Tensor  # [canvases, CL] float32 log-probability of each token in `tokens`
    accepted: torch.Tensor  # [canvases, CL] bool: where the next input keeps this step's token (else renoised)
    finished: torch.Tensor  # [canvases] bool
    dist: Distribution  # the step's distribution statistics (top logprobs, soft embeddings, commit)
    # [canvases, CL] bool: positions the step did not compute (settled before it, fast mode), whose
    # self-conditioning rows stay as they were; None: it computed every position.
    frozen: torch.Tensor | None = None


class DiffusionSampler:
    """The base of every sampler: the field table's generic parts (resolving a request's values,
    building per-canvas tensors), and the interface the edge and the workers call."""

    name: ClassVar[str]
    fields: ClassVar[tuple[SamplerField, ...]]  # the request fields this sampler reads (its table)
    self_conditioning: ClassVar[bool] = False  # whether the model's soft_embed feeds the next step
    # The --logprobs-mode values it can report: a sampler whose logprobs come from the step that
    # finishes the canvas converts them from that step's distribution (VocabParallel.reported).
    logprobs_modes: ClassVar[tuple[str, ...]] = LOGPROBS_MODES

    # ---- one request, on the host (the edge) ----------------------------------------------------
    def resolve(self, params: SamplingParams, defaults: dict, max_steps: int = INT32_MAX) -> SamplingParams:
        """`params` with every field of this sampler's table set (the request's value, else
        `defaults`), checked against the steps limit `max_steps`. A field of another sampler that is
        set to anything but a neutral value (`SamplerField.neutral`) is refused (InvalidParam naming it)."""
        mine = {f.name for f in self.fields}
        for f in SAMPLER_FIELDS:
            value = getattr(params, f.name)
            if f.name not in mine and value is not None and value not in f.neutral:
                raise InvalidParam(f.name, f"{f.name} is not a parameter of this model's sampler, {self.name}, "
                                           f"which takes {', '.join(sorted(mine))}")
        for name in params.extra_args or {}:
            if name not in mine:
                raise InvalidParam(name, f"{name} is not a parameter of this model's sampler, {self.name}, which "
                                         f"takes {', '.join(sorted(mine))}")
        values = {}
        for f in self.fields:
            value = field_value(params, f.name)
            values[f.name] = defaults[f.name] if value is None else value
            check_field(f, values[f.name])
        out = with_field_values(params, values)
        for f in self.fields:
            if f.steps and values[f.name] > max_steps:
                raise InvalidParam(f.name, f"{f.name} must be at most {max_steps} (this engine's denoising-steps "
                                           f"limit), got {values[f.name]}")
        return self.after_resolve(out, params)

    def after_resolve(self, resolved: SamplingParams, given: SamplingParams) -> SamplingParams:
        """What the sampler does beyond filling its fields (`given`: the request's own values)."""
        return resolved

    def canvas_values(self, params: SamplingParams) -> dict[str, int | float]:
        """A resolved request's value of each per-canvas field of the table: what its canvases'
        StepParams rows hold (resolved once, at the edge, into `ResolvedParams.per_canvas`)."""
        return {f.name: field_value(params, f.name) for f in self.fields if f.per_canvas}

    def request_options(self, params: SamplingParams) -> dict[str, bool]:
        """The step options a resolved request raises (`ResolvedParams.options`): a step's option is
        set when any of its canvases raises it (step.step_options)."""
        return {}

    params_type: ClassVar[type[StepParams]]  # what `step` takes

    # ---- one rank (worker) --------------------------------------------------------------------
    def step_params(self, steps: list[int], values: list[dict[str, int | float]], seeds: list[int],
                    canvases: list[int]) -> StepParams:
        """The inputs of canvases at steps `steps` (n, counting down), canvas indices `canvases` of
        requests with per-canvas field values `values` (`canvas_values`) and `seeds`: one tensor per
        per-canvas field of the sampler's table. Each rank builds them when requests take their slots
        (`step.NewRequests`) and keeps them per slot."""
        return self.params_type(step=torch.tensor(steps, dtype=torch.int32),
                                seed=torch.tensor([randoms.seed_words(s) for s in seeds], dtype=torch.long),
                                canvas=torch.tensor(canvases, dtype=torch.long), **per_canvas(self.fields, values))

    def params_table(self, rows: int, device: torch.device) -> StepParams:
        """Each rank's per-slot parameters, `rows` rows on `device`: every field at its reference
        default until a request takes the row (a padded canvas reads one that was never taken)."""
        with torch.device(device):
            fields = {f.name: torch.full((rows,), f.default, dtype=getattr(torch, f.dtype))
                      for f in self.fields if f.per_canvas}
            return self.params_type(step=torch.ones(rows, dtype=torch.int32), seed=torch.zeros(rows, 2, dtype=torch.long),
                                    canvas=torch.zeros(rows, dtype=torch.long), **fields)

    def start_canvas(self, seed: torch.Tensor, canvas: torch.Tensor, canvas_length: int, vocab_size: int) -> torch.Tensor:
        """The first input [canvases, CL] int64 of canvases `canvas` [canvases] of requests with
        `seed` [canvases, 2]: uniform random tokens (a uniform-noise diffusion model), counted
        (randoms.START) so that a canvas starts from the same noise wherever it runs."""
        words = randoms.canvas_words(seed, canvas, torch.zeros_like(canvas), randoms.START, canvas_length)
        return randoms.below(words[0], vocab_size)

    def new_state(self, rows: int, canvas_length: int, hidden_size: int, dtype: torch.dtype,
                  device: torch.device) -> SlotState:
        raise NotImplementedError

    def step(self, logits: torch.Tensor, state: SlotState, slots: torch.Tensor, params: StepParams,
             vocab: VocabParallel) -> StepResult:
        """One step of the canvases in `slots` from their logits [canvases, CL, local vocab] float32
        (overwritten); reads `state`, writes nothing."""
        raise NotImplementedError

    def commit(self, result: StepResult, params: StepParams) -> torch.Tensor:
        """What each canvas commits if this step finishes it [canvases, CL]; by default the sampler's
        own tokens. Structured outputs replace those of the constrained canvases that finished,
        after the step, from `result.dist` (diffusion/constrained.py, ModelRunner._constrain)."""
        return result.tokens


def per_canvas(fields: tuple[SamplerField, ...], values: list[dict[str, int | float]]) -> dict[str, torch.Tensor]:
    """One tensor [canvases] per per-canvas field of `fields`, in the field's dtype."""
    return {f.name: torch.tensor([v[f.name] for v in values], dtype=getattr(torch, f.dtype))
            for f in fields if f.per_canvas}
