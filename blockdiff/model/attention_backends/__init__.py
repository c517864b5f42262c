"""Attention backends, in the manner of vLLM's: each owns the KV layout it reads, the per-step
metadata it needs and its kernel, in one module with `NAME`, `build_metadata` (a mixed step, from
the rows on the host) and `canvas_metadata` (a step of canvases only, on the device, no host sync).

- `reference`: exact and batch-invariant on every device, tuned for the CPU (attention_backends/reference.py);
- `triton`: one Triton kernel over every row of a step, reading the paged cache in place (CUDA).

`choose_attention_backend` picks one once, at start-up; the name then travels in `CacheGeometry.backend`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from blockdiff.model.attention_backends import reference

# Name -> module; the Triton one is imported only when chosen (it imports triton).
BACKENDS = {
    "reference": "blockdiff.model.attention_backends.reference",
    "triton": "blockdiff.model.attention_backends.triton_paged",
}
AUTO = "auto"
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# The reference is always there: steps built without a chosen backend (tests, tools) use it, compiled too.
_LOADED: dict[str, ModuleType] = {"reference": reference}


def backend_module(name: str) -> ModuleType:
    """The backend's module, imported on first use. choose_attention_backend imports it at start-up,
    so that a compiled step only looks it up (torch.compile cannot trace an import)."""
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(BACKENDS[name])
    return _LOADED[name]


def _triton_runs(device: torch.device) -> bool:
    """Triton compiles for a CUDA device, or runs anywhere under its interpreter (TRITON_INTERPRET=1)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def choose_attention_backend(device: torch.device | str, dtype: torch.dtype, requested: str | None = None,
                             fp8_cache: bool = False) -> str:
    """The attention backend for `device` and the model's `dtype`: `requested` (a name of BACKENDS)
    if it can run there, else a ValueError saying why; None or "auto": triton on a CUDA device of
    capability 8.0 or more where triton imports (bf16 products need Ampere; 8.9 with an FP8 cache,
    `fp8_cache`, whose float8e4nv loads Triton compiles from Ada on), else reference. Its module is
    imported here, at start-up."""
    name = _choose(torch.device(device), dtype, requested, fp8_cache)
    backend_module(name)
    return name


# Triton converts float8e4nv from compute capability 8.9 (Ada, Hopper) on.
FP8_CAPABILITY = (8, 9)


def _choose(device: torch.device, dtype: torch.dtype, requested: str | None, fp8_cache: bool) -> str:
    has_triton = importlib.util.find_spec("triton") is not None
    capability = FP8_CAPABILITY if fp8_cache else (8, 0)
    if requested in (None, AUTO):
        if (device.type == "cuda" and has_triton and dtype in TRITON_DTYPES
                and torch.cuda.get_device_capability(device) >= capability):
            return "triton"
        return "reference"
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}: choose one of {', '.join((AUTO, *BACKENDS))}")
    if requested == "triton":
        if not has_triton:
            raise ValueError("attention backend 'triton' needs the triton package, which is not installed")
        if not _triton_runs(device):
            raise ValueError(f"attention backend 'triton' runs on CUDA devices (or under TRITON_INTERPRET=1), "
                             f"not on {device.type}; use 'reference' or 'auto'")
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"attention backend 'triton' takes bfloat16, float16 or float32, not {dtype}")
        if fp8_cache and device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
            raise ValueError("attention backend 'triton' reads an FP8 KV cache on GPUs of compute capability 8.9 "
                             "or more; use 'reference' or --kv-cache-dtype auto")
    return requested
