"""blockdiff/ops/intmm.py: weight-only integer products by each kernel (torch's CPU weight-only
kernels and the dequantize-a-tile path) against a float64 product on the dequantized weight, at 1,
7, 16 and 64 rows, odd widths and each group size; packing along with compressed-tensors'."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from torch import nn

from blockdiff.ops.intmm import (
    FAST_ROWS, INT4_GROUPS, INT8_ROWS, dequantize, fast_kernel, int_linear, regular_groups, torch_kernel_linear,
    unpack_int32,
)

ROWS = (1, 7, 16, 64)
# (bits, group size, symmetric, out, in): odd output widths (40 and 24 are no multiple of 16, so
# int4 takes the tile path there), in widths of several groups
SCHEMES = [
    (8, None, True, 40, 72),
    (8, None, True, 24, 96),
    (8, None, False, 40, 72),
    (8, 32, True, 48, 96),
    (4, 32, True, 48, 96),
    (4, 32, False, 48, 96),
    (4, 32, False, 40, 96),
    (4, 64, True, 32, 192),
    (4, 128, False, 48, 256),
    (4, 256, True, 16, 512),
    (4, None, False, 24, 72),
]


def _weight(bits, group_size, symmetric, out, inp, seed=0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    groups = 1 if group_size is None else inp // group_size
    q = torch.randint(lo, hi + 1, (out, inp), generator=g, dtype=torch.int8)
    scale = torch.rand(out, groups, generator=g) * 0.02 + 0.001
    zero = None if symmetric else torch.randint(lo, hi + 1, (out, groups), generator=g).float()
    return q, scale, zero


def _reference(x, q, scale, zero, group_size):
    """x @ W.T in float64, W dequantized group by group in float64."""
    per = q.shape[1] if group_size is None else group_size
    s = scale.double().repeat_interleave(per, dim=1)
    w = q.double() - (0 if zero is None else zero.double().repeat_interleave(per, dim=1))
    return x.double() @ (w * s).T


def _err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bits, group_size, symmetric, out, inp", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_equals_the_float64_dequantized_product(bits, group_size, symmetric, out, inp, rows, dtype):
    q, scale, zero = _weight(bits, group_size, symmetric, out, inp)
    q, scale = nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False)  # packed once, as layers'
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)).to(dtype)
    ref = _reference(x, q, scale, zero, group_size)
    kernel = fast_kernel(bits, group_size, symmetric, out, inp, 0)
    assert kernel == {(8, None, True): INT8_ROWS if inp % 16 == 0 else None}.get(
        (bits, group_size, symmetric), INT4_GROUPS if bits == 4 and group_size and out % 16 == 0 else None)
    segments = [(0, out, regular_groups(0, inp, group_size))]
    # float32: rounding of the sums only; bfloat16: x and the result rounded to bfloat16, scales too in torch's kernels
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    aligned = [(0, out, None)]  # groups in contiguous runs from column 0: scales broadcast
    products = {"tile": int_linear(x, q, scale, zero, segments), "aligned tile": int_linear(x, q, scale, zero, aligned),
                "chosen": int_linear(x, q, scale, zero, aligned, kernel)}
    if kernel is not None:
        products[kernel] = torch_kernel_linear(kernel, x, q, scale, zero)
    for k, y in products.items():
        assert y.dtype == dtype and y.shape == (rows, out)
        assert _err(y, ref) < tol, (k, _err(y, ref))


def test_rows_past_fast_rows_take_the_tile_path_and_agree():
    q, scale, zero = _weight(4, 32, False, 48, 96)
    x = torch.randn(FAST_ROWS + 1, 96)
    segments = [(0, 48, regular_groups(0, 96, 32))]
    y = int_linear(x, q, scale, zero, segments, INT4_GROUPS)
    tile = int_linear(x, q, scale, zero, segments, None)
    assert torch.equal(y, tile)  # the same kernel: above FAST_ROWS torch's is not called
    assert _err(y, _reference(x, q, scale, zero, 32)) < 2e-6


def test_a_weight_written_in_place_is_packed_again():
    q, scale, zero = _weight(4, 32, True, 48, 96)
    q, scale = nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False)
    x, segments = torch.randn(3, 96), [(0, 48, regular_groups(0, 96, 32))]
    int_linear(x, q, scale, zero, segments, INT4_GROUPS)
    with torch.no_grad():
        q.neg_().clamp_(-8, 7)
        scale.mul_(2)
    assert _err(int_linear(x, q, scale, zero, segments, INT4_GROUPS), _reference(x, q, scale, zero, 32)) < 2e-6


def test_act_order_segments_take_each_rows_own_groups():
    """GPTQ's act-order: two parts of a fused weight, each with its own scattered group of every column."""
    q, scale, zero = _weight(4, 32, False, 32, 96)
    g = torch.Generator().manual_seed(3)
    index = [torch.randperm(96, generator=g) // 32 for _ in range(2)]
    x = torch.randn(7, 96, dtype=torch.float64)
    y = int_linear(x, q, scale, zero, [(0, 16, index[0]), (16, 32, index[1])])
    for part, rows in enumerate((slice(0, 16), slice(16, 32))):
        w = (q[rows].double() - zero[rows].double()[:, index[part]]) * scale[rows].double()[:, index[part]]
        torch.testing.assert_close(y[:, rows], x @ w.T, rtol=1e-12, atol=1e-12)


def test_group_index_of_a_shard_that_cuts_a_group():
    assert regular_groups(48, 48, 32).tolist() == [0] * 16 + [1] * 32
    assert regular_groups(5, 3, None).tolist() == [0, 0, 0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 72])
def test_unpacking_inverts_compressed_tensors_packing(bits, n):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values = torch.randint(lo, hi + 1, (5, n), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(values, bits), bits, n), values)
    assert torch.equal(unpack_int32(pack_to_int32(values.T.contiguous(), bits, packed_dim=0), bits, n, dim=0), values.T)


def test_dequantize_per_group():
    q = torch.tensor([[1, -2, 3, 4]], dtype=torch.int8)
    scale, zero = torch.tensor([[0.5, 2.0]]), torch.tensor([[1.0, -1.0]])
    assert dequantize(q, scale, zero, regular_groups(0, 4, 2)).tolist() == [[0.0, -1.5, 8.0, 10.0]]
