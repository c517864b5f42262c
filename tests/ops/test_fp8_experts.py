"""The FP8 experts at the 26B-A4B widths against bfloat16 experts holding the dequantized weights,
on the test device (BLOCKDIFF_TEST_DEVICE). It imports nothing the GPU machine lacks
(compressed-tensors, the oracle of tests/model/test_fp8.py): scripts/device_check.sh runs it there."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from helpers import DEVICE, rel_err

from blockdiff.ops.fp8 import quantize_rows
from blockdiff.ops.kernels import PER_EXPERT, SCALED_GROUPED, target
from blockdiff.model.moe import Experts
from blockdiff.model.quantize import FP8_DYNAMIC
from blockdiff.model.registry import load_config
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.quantization.fp8 import Fp8ExpertsMethod

BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "diffusiongemma-26b-a4b.json")


def test_fp8_experts_equal_the_dequantized_bfloat16_experts():
    """16 of the 128 experts, top 4, run as the kernel blockdiff/ops/kernels.py picks on the device (one
    torch._scaled_grouped_mm per projection on CUDA 9.x / 10.x, one product per expert on the CPU):
    within FP8's activation rounding of bfloat16 experts holding the dequantized weights."""
    arch = replace(load_config(BIG).arch, num_experts=16, top_k_experts=4)
    tokens = 512 if DEVICE.type == "cuda" else 64  # the CPU's per-expert products: seconds, not minutes
    g = torch.Generator(DEVICE).manual_seed(0)
    with torch.device(DEVICE), torch.inference_mode():
        fp8, ref = Experts(arch, TPGroup(), torch.bfloat16, Fp8ExpertsMethod(FP8_DYNAMIC)), Experts(arch, TPGroup(), torch.bfloat16)
        for name in ("gate_up", "down"):
            w = torch.randn(getattr(ref, name).shape, generator=g, device=DEVICE) * 0.02
            q, scale = quantize_rows(w, "channel")
            getattr(fp8, name).copy_(q)
            getattr(fp8, f"{name}_scale").copy_(scale.float())
            getattr(ref, name).copy_((q.float() * scale.float()).bfloat16())
        x = torch.randn(tokens, arch.hidden_size, generator=g, device=DEVICE).bfloat16()
        weights = torch.rand(tokens, 4, generator=g, device=DEVICE)
        index = torch.stack([torch.randperm(16, generator=g, device=DEVICE)[:4] for _ in range(tokens)])
        got, want = fp8(x, weights, index), ref(x, weights, index)
    if DEVICE.type == "cuda":
        major = torch.cuda.get_device_capability(DEVICE)[0]
        assert (fp8.kernel(x) == SCALED_GROUPED) == (major in (9, 10) and hasattr(torch, "_scaled_grouped_mm")), target(DEVICE)
    else:
        assert fp8.kernel(x) == PER_EXPERT
    assert got.abs().mean() > 0
    assert rel_err(got, want) < 0.1  # FP8 rounds both products' inputs: 0.043 on the CPU's per-expert path
