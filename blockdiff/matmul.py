"""`linear(x, weight)`: x @ weight.T through the fastest exact kernel of the device.

On x86 CPUs PyTorch sends float32 `F.linear` to MKL's sgemm, which takes an AVX2 path on AMD
processors; oneDNN's float32 kernel uses AVX-512 where the CPU has it and runs the same products
about twice as fast (docs/benchmarks.md). It is full float32 arithmetic, like sgemm. Like sgemm it
computes a row the same way wherever it sits in a product whose row count is a multiple of 8, which
keeps requests batch-invariant (see ROW_ALIGN in model/attention.py).
Everything else (GPUs, reduced precision, where oneDNN is missing, training) stays on `F.linear`.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

_ONEDNN_FP32 = (
    torch.backends.mkldnn.is_available()
    and platform.machine().lower() in ("x86_64", "amd64")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)


def onednn_float32(x: torch.Tensor) -> bool:
    """Whether `linear` runs products of `x` on oneDNN's float32 kernel. Not when `x` needs a
    gradient (the demo trainer): the oneDNN op has no autograd formula."""
    return _ONEDNN_FP32 and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T; `weight` may be a transposed view."""
    if onednn_float32(x) and not weight.requires_grad and x.numel():
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)
