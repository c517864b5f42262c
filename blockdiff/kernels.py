"""Which kernels a model runs on a device, decided in one place.

torch's grouped products (`torch._grouped_mm`, `torch._scaled_grouped_mm`) read every matrix with
a leading stride that must be a multiple of 16 bytes, and the FP8 one wants its dimensions
divisible by 16. Widths that miss (an expert's per-rank intermediate width, an odd hidden size) are
zero-padded at load time to `padded(n, dtype)`: zero columns of gate/up and zero rows of down add
nothing, so the padded product is exact.
"""

from __future__ import annotations

import torch

ALIGN_BYTES = 16  # torch's grouped products: leading strides (and FP8 dimensions) of 16 bytes


def padded(n: int, dtype: torch.dtype) -> int:
    """n rounded up to a whole number of 16-byte rows of `dtype` (16 elements of FP8, 8 of bf16, 4 of float32)."""
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-n // step) * step
