"""The CPU's features that decide kernels and dtypes: read once from torch, importing nothing else."""

from __future__ import annotations

import torch

# CPU features under which oneDNN multiplies bfloat16 at a multiple of float32's rate (AMX tiles, or
# AVX-512's bfloat16 dot products); elsewhere the CPU converts bfloat16 to float32 for every product.
BF16_CPU_FEATURES = ("amx_bf16", "avx512_bf16")


def cpu_features() -> tuple[str, ...]:
    """Those of BF16_CPU_FEATURES this CPU has (torch.cpu.get_capabilities, torch >= 2.7)."""
    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        return ()
    return tuple(f for f in BF16_CPU_FEATURES if caps.get(f))
