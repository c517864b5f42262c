"""bfloat16 products where the CPU has no bfloat16 kernels: float32 products over weights widened a
tile at a time (ops/matmul.py `_float32_linear`), and the experts' layout on such a CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from blockdiff.ops.kernels import BF16_WIDENED, GROUPED, INSTALLED, ExpertShape, Target, expert_kernel, transposed_layout
from blockdiff.ops.matmul import WIDEN_ELEMENTS, _float32_linear

BF16_STEP = 2**-7  # bfloat16's relative rounding step


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed-view"])
def test_a_widened_product_is_the_float32_product_rounded_once_without_a_whole_float32_weight(transposed):
    """Three tiles of a plain [out, in] weight, or of a transposed view (the soft embedding's
    table): the float32 product rounded to bfloat16, and no allocation as large as the weight
    widened whole."""
    g = torch.Generator().manual_seed(0)
    n_out, n_in = (700, 3 * WIDEN_ELEMENTS // 700 - 5) if transposed else (3 * WIDEN_ELEMENTS // 256 - 7, 256)
    x = torch.randn(24, n_in, generator=g).bfloat16()
    w = torch.randn(n_in, n_out, generator=g).bfloat16().t() if transposed else torch.randn(n_out, n_in, generator=g).bfloat16()
    want = F.linear(x.float(), w.float())
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = _float32_linear(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want).abs() <= BF16_STEP * want.abs() + 1e-3).all()
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert largest < n_out * n_in * 4 / 2, largest  # tiles of WIDEN_ELEMENTS, never the whole widened weight


def test_bfloat16_experts_keep_the_checkpoint_layout_on_a_cpu_without_bfloat16_kernels():
    """Where torch's generic bfloat16 loops read the [in, out] layout slower, bfloat16 experts keep
    the checkpoint's; float32 and bfloat16 on oneDNN take [in, out]. The features are injected: no
    test depends on this machine's CPU."""
    widened = Target("cpu", features=frozenset({BF16_WIDENED}))
    bf16, f32 = ExpertShape(2816, 704, torch.bfloat16), ExpertShape(2816, 704, torch.float32)
    assert expert_kernel(widened, torch.bfloat16, bf16)[0] == GROUPED  # a static step all the same
    assert not transposed_layout(widened, torch.bfloat16, bf16)
    assert transposed_layout(widened, torch.float32, f32)
    torch_grouped = replace(INSTALLED, cpu_bf16_grouped=False)  # not blockdiff's kernel, which reads [out, in]
    assert transposed_layout(Target("cpu", features=frozenset({"avx512_bf16"})), torch.bfloat16, bf16, torch_grouped)
