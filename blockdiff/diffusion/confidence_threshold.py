"""The confidence-threshold sampler: commit every position whose top probability reaches a threshold.

The parallel decoding of Fast-dLLM and SGLang's `LowConfidence` algorithm, for a uniform-noise
model such as DiffusionGemma (an opt-in: `--diffusion-sampler confidence_threshold`). Per canvas
and step, with n counting down from max_denoising_steps to 1:
  the model's distribution at each position (temperature 1, no self-conditioning);
  every open position whose most likely token has probability >= `threshold` is committed to that
  token, and so is the most likely open position when none reaches it (at least one per step);
  committed positions keep their token for the rest of the canvas, open ones are renoised to
  uniform random tokens;
  the canvas is done when every position is committed, or when the steps run out (the open
  positions then take their most likely token).
Tokens are the argmax (greedy decoding): `temperature` is accepted as 0 only, and the candidate
draw's knobs (top_k, top_p, min_p) at their neutral values only. A token's logprob is its top
log-probability at the step that committed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdiff.diffusion import randoms
from blockdiff.diffusion.strategy import DiffusionSampler, SlotState, StepParams, StepResult, start, step_words
from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.sampling_params import ENGINE_FIELDS, InvalidParam, SamplerField, SamplingParams

FIELDS = ENGINE_FIELDS + (
    SamplerField("threshold", float, 0.95, "commit a position once its most likely token has at least this "
                 "probability", 0, 1, exclusive_minimum=True),
)


@dataclass
class ConfidenceParams(StepParams):
    max_denoising_steps: torch.Tensor  # [canvases] int32
    threshold: torch.Tensor  # [canvases] float32


@dataclass
class ConfidenceState(SlotState):
    fixed: torch.Tensor = start(False)  # [slots + 1, CL] bool: committed positions
    logprob: torch.Tensor = start(0.0)  # [slots + 1, CL] float32: each committed token's logprob


class ConfidenceThreshold(DiffusionSampler):
    name = "confidence_threshold"
    fields = FIELDS
    params_type = ConfidenceParams
    # A token's logprob is from the step that committed it, whose logits are not kept; at this
    # sampler's temperature 1 the raw log-probabilities are the processed ones.
    logprobs_modes = ("raw_logprobs", "processed_logprobs")

    def after_resolve(self, resolved: SamplingParams, given: SamplingParams) -> SamplingParams:
        if given.temperature not in (None, 0):
            raise InvalidParam("temperature", f"temperature {given.temperature}: the {self.name} sampler commits "
                                              "each position's most likely token (greedy); only 0 is accepted")
        return resolved

    def new_state(self, rows: int, canvas_length: int, hidden_size: int, dtype: torch.dtype,
                  device: torch.device) -> ConfidenceState:
        with torch.device(device):
            return ConfidenceState(canvas=torch.zeros(rows, canvas_length, dtype=torch.long),
                                   fixed=torch.zeros(rows, canvas_length, dtype=torch.bool),
                                   logprob=torch.zeros(rows, canvas_length))

    def step(self, logits: torch.Tensor, state: ConfidenceState, slots: torch.Tensor, params: ConfidenceParams,
             vocab: VocabParallel) -> StepResult:
        dist = vocab.distribution(logits)
        argmax = vocab.argmax(dist)
        top = -dist.log_total  # log-probability of the most likely token: its weight exp(0) over the total
        canvas, fixed = state.canvas.index_select(0, slots), state.fixed.index_select(0, slots)
        confident = (top >= params.threshold.log().unsqueeze(-1)) & ~fixed
        # At least one position per step: the most likely open one (nothing when all are committed).
        best = torch.where(fixed, float("-inf"), top).argmax(dim=-1, keepdim=True)
        none = ~confident.any(dim=-1, keepdim=True) & ~fixed.all(dim=-1, keepdim=True)
        new = confident | (torch.zeros_like(fixed).scatter(-1, best, True) & none)
        now_fixed = fixed | new
        tokens = torch.where(fixed, canvas, argmax)  # committed tokens stay; open positions: the argmax
        logprob = torch.where(new, top, state.logprob.index_select(0, slots))
        finished = now_fixed.all(dim=-1) | (params.step <= 1)
        renoise = randoms.below(step_words(params, canvas.shape[1])[1], vocab.shard.vocab_size)  # the renoise word
        return StepResult(
            updates={"canvas": torch.where(now_fixed, tokens, renoise), "fixed": now_fixed, "logprob": logprob},
            tokens=tokens, logprob=torch.where(now_fixed, logprob, top), accepted=now_fixed, finished=finished, dist=dist)
