"""blockdiff's AVX512-BF16 grouped expert kernel (blockdiff/ops/cpu_grouped.py): float products to
bfloat16's rounding, padding rows set to 0, a row's bits independent of the rows beside it, and the
experts of a bfloat16 model through it. It runs only on CPUs with AVX512-BF16 and no AMX: elsewhere
these tests skip (tests/ops/test_kernels.py checks the choice of kernel on every CPU)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from blockdiff.model.registry import load_config
from blockdiff.model.moe import Experts
from blockdiff.ops import cpu_grouped
from blockdiff.ops.kernels import GROUPED, kernel_on
from blockdiff.parallel.group import TPGroup

BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                   "diffusiongemma-26b-a4b.json")


@pytest.fixture(scope="module")
def ext():
    if not cpu_grouped.runs_here():
        pytest.skip("this CPU has no AVX512-BF16 (or has AMX): the kernel does not run here")
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        pytest.skip("no ninja on PATH: the kernel cannot be built here (the experts take torch's kernel)")
    module = cpu_grouped.extension()
    assert module is not None, "the kernel should build on this CPU (see the log)"
    return module


def _operands(sizes: list[int], n_out: int, n_in: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes) + 3, n_in, generator=g).bfloat16()  # 3 rows past the last group
    w = torch.randn(len(sizes), n_out, n_in, generator=g).bfloat16()
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return x, w, ends


def _reference(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(int(ends[-1]), w.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end].double() @ w[e].double().T
        start = end
    return out


@pytest.mark.parametrize("sizes,n_out,n_in", [
    ([3, 0, 8, 1, 5], 13, 100),  # an empty group, row and output blocks with remainders, a masked tail of 4
    ([16, 9], 64, 256),  # the down projection's inner width
    ([4, 12, 2], 130, 1024),  # more outputs than one work item
])
def test_the_kernel_multiplies_as_float_products_rounded_once(ext, sizes, n_out, n_in):
    x, w, ends = _operands(sizes, n_out, n_in)
    got = ext.grouped_mm_bf16(x, w, ends, None)
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], n_out)
    want = _reference(x, w, ends)
    # float32 sums of exact bfloat16 products, rounded to bfloat16 once: within a unit in the last place
    scale = (x[: int(ends[-1])].double().abs() @ w.double().abs().amax(0).T)
    err = (got[: int(ends[-1])].double() - want).abs()
    assert bool((err <= want.abs() * 2**-8 + scale * 2**-20).all()), float(err.max())
    # the same through torch's grouped product in float32
    ref32 = torch._grouped_mm(x.float(), w.float().transpose(1, 2), offs=ends)[: int(ends[-1])]
    torch.testing.assert_close(got[: int(ends[-1])].float(), ref32, rtol=2**-7, atol=1e-4)


def test_counts_multiply_only_the_rows_each_group_begins_with(ext):
    x, w, ends = _operands([8, 8, 16], 24, 64, seed=1)
    counts = torch.tensor([3, 0, 16], dtype=torch.int32)
    full = ext.grouped_mm_bf16(x, w, ends, None)
    got = ext.grouped_mm_bf16(x, w, ends, counts)
    starts = [0, 8, 16]
    for e, (s, c) in enumerate(zip(starts, counts.tolist())):
        end = int(ends[e])
        assert torch.equal(got[s : s + c], full[s : s + c])
        assert bool((got[s + c : end] == 0).all())


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(ext):
    """Batch invariance: a row alone and the same row among 11 others, at another offset, in the
    same bits."""
    x, w, ends = _operands([11, 5], 40, 300, seed=2)
    crowd = ext.grouped_mm_bf16(x, w, ends, None)
    for row, e in ((0, 0), (7, 0), (10, 0), (13, 1)):
        alone = ext.grouped_mm_bf16(x[row : row + 1], w[e : e + 1], torch.tensor([1], dtype=torch.int32), None)
        assert torch.equal(alone[0], crowd[row])


def test_it_refuses_what_it_cannot_multiply(ext):
    x, w, ends = _operands([4], 8, 64)
    assert cpu_grouped.grouped_mm_bf16(x.float(), w.float(), ends) is None  # another dtype: torch's kernel
    assert cpu_grouped.grouped_mm_bf16(x, w.transpose(1, 2).contiguous().transpose(1, 2), ends) is None  # [in, out]
    with pytest.raises(RuntimeError, match="not past the rows"):
        ext.grouped_mm_bf16(x[:2], w, ends, None)
    x2, w2, _ = _operands([2, 2], 8, 64)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        ext.grouped_mm_bf16(x2, w2, torch.tensor([3, 1], dtype=torch.int32), None)


def test_bfloat16_experts_run_on_it_and_agree_with_float32_ones(ext):
    """A bfloat16 MoE layer on this CPU takes the kernel, in the checkpoint's layout, and gives what
    the same weights give in float32, to bfloat16's precision."""
    torch.manual_seed(0)
    config = replace(load_config(BIG).arch, num_experts=8, top_k_experts=2, hidden_size=64, moe_intermediate_size=32)
    layers = {dtype: Experts(config, TPGroup(), dtype) for dtype in (torch.bfloat16, torch.float32)}
    bf16 = layers[torch.bfloat16]
    assert bf16.gate_up.stride(-1) == 1  # [out, in]
    bf16.gate_up.data.normal_(0, 0.1)
    bf16.down.data.normal_(0, 0.1)
    bf16.zero_padding()
    layers[torch.float32].load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    x = torch.randn(40, 64).bfloat16()
    index = torch.stack([torch.arange(40) % 8, (torch.arange(40) * 3 + 1) % 8], dim=1)
    weights = torch.rand(40, 2)
    calls = []
    run = cpu_grouped.grouped_mm_bf16

    def counted(*args):
        out = run(*args)
        if args[0].dtype == torch.bfloat16:
            calls.append(out is not None)
        return out

    cpu_grouped.grouped_mm_bf16 = counted
    try:
        with torch.inference_mode():
            assert kernel_on(x.device, torch.bfloat16, bf16.shape) == GROUPED
            got = bf16(x, weights, index)
            want = layers[torch.float32](x.float(), weights, index)
    finally:
        cpu_grouped.grouped_mm_bf16 = run
    assert calls and all(calls)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
