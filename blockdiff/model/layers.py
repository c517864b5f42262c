"""Small building blocks: RMSNorm, rotary position embedding, the activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.model.gemma_config import LayerSpec


class RMSNorm(nn.Module):
    """x / rms(x) [* weight], computed in float32 like the reference, returned in x's dtype."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(unit_rms(x, self.eps), x.dtype)

    def scaled(self, unit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This norm of x from unit_rms(x): norms of the same input share one unit_rms, whose
        product with the weight is the same bits as the norm computed whole."""
        return (unit if self.weight is None else unit * self.weight.float()).to(dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32 (F.rms_norm, fused where the device has a kernel)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu_pytorch_tanh": gelu_tanh, "gelu_tanh": gelu_tanh}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_activation {name!r}")
    return ACTIVATIONS[name]


class Rotary(nn.Module):
    """RoPE of one layer kind. "Proportional" RoPE rotates only the first rotary_dim/2 frequency pairs;
    the other pairs have frequency 0 (cos 1, sin 0), which leaves those dims position-free."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        half = spec.head_dim // 2
        exponents = torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64).float() / spec.head_dim
        inv_freq = torch.zeros(half)
        inv_freq[: spec.rotary_dim // 2] = 1.0 / (spec.rope_theta**exponents)
        self.register_buffer("inv_freq", inv_freq / spec.rope_factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim]; cos/sin [tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
