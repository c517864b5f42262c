"""The sampler's kernel backends, chosen once at start-up: `reference` (torch ops, the exact CPU
reference: diffusion/vocab_parallel.py's `ReferenceKernels`) and `triton` (blockdiff/ops/
triton_sampler.py, for CUDA). Both serve the same passes of `VocabParallel`, which keeps the
collectives, so one rank and many run the same code with either.

The Triton backend works on the logits as they are, with no [positions, vocabulary] temporary: its
`weights` are the shifted logits themselves (each kernel exponentiates what it reads), and the
self-conditioning probabilities are written in the model's dtype, a tile of positions at a time.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from blockdiff.diffusion.vocab_parallel import CHUNK, ReferenceKernels

BACKENDS = ("reference", "triton")


def choose_sampler_backend(device: torch.device | str, requested: str = "auto") -> str:
    """The backend for a sampler on `device`: `requested` ("reference", "triton"), or for "auto"
    Triton on CUDA where triton is installed and the reference otherwise. Triton off CUDA runs only
    under Triton's interpreter (TRITON_INTERPRET=1)."""
    device = torch.device(device)
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"sampler backend {requested!r}: choose one of auto, {', '.join(BACKENDS)}")
    has_triton = importlib.util.find_spec("triton") is not None
    if requested == "auto":
        return "triton" if device.type == "cuda" and has_triton else "reference"
    if requested == "triton":
        if not has_triton:
            raise ValueError("the triton sampler backend needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton sampler backend runs on CUDA (or under TRITON_INTERPRET=1), not on {device}")
    return requested


def sampler_kernels(name: str) -> ReferenceKernels:
    """The backend `name` (choose_sampler_backend's answer)."""
    return {"reference": ReferenceKernels, "triton": TritonKernels}[name]()


class TritonKernels(ReferenceKernels):
    """The sampler's passes as Triton kernels: every one reads the logits [positions, local vocab]
    in tiles and returns per-position or per-chunk results only."""

    name = "triton"
    restrict_bytes = 0  # no temporary of the vocabulary's width: one tile of every position
    # Each pass over the logits counts (or adds) at 16 thresholds at once: 8 passes narrow the
    # float32 bits of a threshold (17^8 > 2^30) where bisection takes 31.
    search_ways, search_steps = 17, 8

    def __init__(self):
        from blockdiff.ops import triton_sampler  # triton imported only where this backend is chosen

        self.ops = triton_sampler

    def chunk_max(self, x: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        return self.ops.chunk_max(x.view(-1, x.shape[-1]), padding, CHUNK).view(*x.shape[:-1], -1)

    def exp_statistics(self, x: torch.Tensor, m: torch.Tensor,
                       tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        """No tile: the kernel keeps nothing beside the logits, and no exp for the product."""
        lead = x.shape[:-1]
        cum, dot = self.ops.exp_statistics(x.view(-1, x.shape[-1]), m.reshape(-1), CHUNK)
        return x, cum.view(*lead, -1), dot.view(lead), None

    def first_argmax(self, y: torch.Tensor, chunk_max: torch.Tensor) -> torch.Tensor:
        lead = y.shape[:-1]
        return self.ops.first_argmax(y.view(-1, y.shape[-1]), chunk_max.reshape(-1, chunk_max.shape[-1]), CHUNK).view(lead)

    def inverse_cdf(self, y: torch.Tensor, cum: torch.Tensor, target: torch.Tensor,
                    threshold: torch.Tensor | None) -> torch.Tensor:
        lead = y.shape[:-1]
        threshold = None if threshold is None else threshold.reshape(-1).contiguous()
        return self.ops.inverse_cdf(y.view(-1, y.shape[-1]), cum.reshape(-1, cum.shape[-1]).contiguous(),
                                    target.reshape(-1).contiguous(), threshold, CHUNK).view(lead)

    def weights(self, y: torch.Tensor) -> torch.Tensor:
        return y  # the kernels exponentiate what they read

    def count_at_least(self, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.ops.count_at_least(w, t.contiguous())

    def at_least(self, w: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w, floor.contiguous()  # the kernel applies the floor as it reads

    def mass_above(self, kept: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor | None) -> torch.Tensor:
        y, floor = kept
        if t is None:  # every weight is > -1
            return self.ops.mass_above(y, torch.full_like(floor, -1.0).unsqueeze(-1), floor).squeeze(-1)
        return self.ops.mass_above(y, t.contiguous(), floor)

    def kept_cumsum(self, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.ops.kept_cumsum(w, t.contiguous(), CHUNK)

    def probs_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # written as the model reads them: no float32 copy beside

    def exp_rows(self, flat: torch.Tensor, start: int, index: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        if index is None:
            index = torch.arange(start, start + out.shape[0], device=flat.device)
        self.ops.exp_rows(flat, index, out)
        return out

    def cumsum(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.row_cumsum(x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape)

    def gather(self, y: torch.Tensor, local: torch.Tensor, owned: torch.Tensor | None) -> torch.Tensor:
        lead = y.shape[:-1]
        owned = torch.ones_like(local, dtype=torch.bool) if owned is None else owned
        return self.ops.gather(y.view(-1, y.shape[-1]), local.reshape(-1).contiguous(),
                               owned.reshape(-1).contiguous()).view(lead)

    def scaled_exp_sum(self, flat: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """No temporary: the kernel scales and exponentiates what it reads."""
        return self.ops.scaled_exp_sum(flat, index.contiguous(), scale.contiguous())
