"""One denoising step of the entropy-bound sampler, batched over canvases.

For each canvas, with n counting down from max_denoising_steps to 1:
  temperature t = t_min + (t_max - t_min) * n / N; processed logits = logits / t;
  candidates drawn from softmax(processed); the argmax canvas kept aside;
  the lowest-entropy positions are accepted while Σentropy - entropy_of_last <= entropy_bound,
  the others renoised to uniform random tokens;
  the canvas is done when the argmax canvas equals the previous `stability_threshold` ones and
  the mean entropy is below `confidence_threshold`, or when the steps run out.
The distribution is computed once (`VocabParallel.distribution`) and everything else derives from it.
top_k, top_p and min_p (vLLM's order: min-p, top-k, then top-p) restrict the candidate draw only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdiff.diffusion.vocab_parallel import Distribution, VocabParallel
from blockdiff.sampling_params import PER_CANVAS_FIELDS


@dataclass
class DenoiseParams:
    """Per-canvas parameters and random draws of one step, [canvases] or [canvases, canvas_length]:
    the step count n, the draws, and one tensor per per-canvas field of the sampler-field table, by
    its name and in its order (tests/test_engine_core.py checks it)."""

    step: torch.Tensor  # int32, steps remaining including this one (n)
    uniform: torch.Tensor  # [canvases, CL] float32 in [0, 1), for candidate sampling
    renoise: torch.Tensor  # [canvases, CL] int64 uniform random tokens
    max_denoising_steps: torch.Tensor  # int32
    entropy_bound: torch.Tensor
    t_min: torch.Tensor
    t_max: torch.Tensor
    stability_threshold: torch.Tensor  # int32
    confidence_threshold: torch.Tensor
    top_k: torch.Tensor  # int32
    top_p: torch.Tensor
    min_p: torch.Tensor
    # Whether any canvas sets top_k, top_p or min_p: decided on the host when the step is planned,
    # so that a step without them never pays for their search.
    restrict: bool = False

    def to(self, device: torch.device | str) -> "DenoiseParams":
        return DenoiseParams(**{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                                for k, v in self.__dict__.items()})


def denoise_params(step: list[int], params: list, uniform: torch.Tensor, renoise: torch.Tensor) -> DenoiseParams:
    """The sampler's inputs for canvases at steps `step` of requests with SamplingParams `params`."""
    per_canvas = {f.name: torch.tensor([getattr(p, f.name) for p in params], dtype=getattr(torch, f.dtype))
                  for f in PER_CANVAS_FIELDS}
    restrict = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
    return DenoiseParams(step=torch.tensor(step, dtype=torch.int32), uniform=uniform, renoise=renoise, **per_canvas,
                         restrict=restrict)


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


def entropy_bound_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Accept the longest lowest-entropy prefix with Σentropy - max entropy <= bound."""
    sorted_entropy, order = torch.sort(entropy, dim=-1)
    keep = (torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy) <= bound.unsqueeze(-1)
    return torch.zeros_like(keep).scatter(-1, order, keep)


def denoise_step(
    logits: torch.Tensor,
    last_argmax: torch.Tensor,
    run: torch.Tensor,
    params: DenoiseParams,
    vocab: VocabParallel,
) -> DenoiseResult:
    """logits [canvases, CL, local vocab] float32 (overwritten)."""
    t = temperature(params.step, params.max_denoising_steps, params.t_min, params.t_max)
    dist = vocab.distribution(logits.div_(t[:, None, None]))
    # top-k, top-p and min-p narrow the candidates only: the argmax, the entropies that accept
    # candidates and stop the canvas, and the self-conditioning input keep the full distribution.
    draw = vocab.restricted_draw(dist, params.top_k, params.top_p, params.min_p) if params.restrict else None
    argmax, candidates = vocab.argmax_and_sample(dist, params.uniform, draw)
    accepted = entropy_bound_accept(dist.entropy, params.entropy_bound)
    canvas = torch.where(accepted, candidates, params.renoise)
    same = (argmax == last_argmax).all(dim=-1)
    run = torch.where(same, run + 1, torch.zeros_like(run))
    stable = run >= params.stability_threshold
    confident = dist.entropy.mean(dim=-1) < params.confidence_threshold
    finished = (stable & confident) | (params.step <= 1)
    return DenoiseResult(canvas, argmax, dist.entropy, accepted, run, finished, dist)
