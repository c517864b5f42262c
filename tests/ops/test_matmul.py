"""`ops/matmul.py`'s `linear`: oneDNN with each parameter's weight packed once, in float32 and
bfloat16, on CPUs where torch runs those products on oneDNN; F.linear everywhere else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.ops import kernels, matmul
from blockdiff.ops.matmul import dense_kernel, grouped_linear, linear, onednn_packed, widens


def _packs(dtype: torch.dtype) -> bool:
    return onednn_packed(torch.ones(1, 1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_parameter_is_packed_once_and_multiplies_like_f_linear(dtype, transposed):
    if not _packs(dtype):
        pytest.skip(f"this CPU runs {dtype} products without oneDNN")
    g = torch.Generator().manual_seed(0)
    # odd widths: 72 and 200 are no multiple of oneDNN's blocks; the transposed view is how the
    # soft embedding reads the embedding
    w = torch.randn(200, 72, generator=g).to(dtype)
    param = nn.Parameter(w.t().contiguous().t() if transposed else w, requires_grad=False)
    x = torch.randn(24, 72, generator=g).to(dtype)
    reference = x.double() @ param.double().t()
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16 rounds each output once: 2^-8 relative
    for rows in (24, 8, 1):
        out = linear(x[:rows], param)
        assert out.dtype == dtype and out.shape == (rows, 200)
        torch.testing.assert_close(out.double(), reference[:rows], rtol=tol, atol=tol * 10)
    packed = matmul._PACKED[id(param)]
    assert len(packed) == 1  # one blocked copy for every call on this weight
    (version, copy), = packed.values()
    assert copy.is_mkldnn and version == param._version
    # a write to the parameter is seen: the next product packs it again
    with torch.no_grad():
        param.mul_(-2)
    torch.testing.assert_close(linear(x, param).double(), -2 * reference, rtol=tol, atol=tol * 20)
    assert next(iter(matmul._PACKED[id(param)].values()))[0] == param._version


def test_what_is_not_packed_goes_to_f_linear():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 8, generator=g)
    x = torch.randn(4, 8, generator=g)
    plain = torch.randn(16, 8, generator=g)  # not a parameter: multiplied as it is, nothing kept
    torch.testing.assert_close(linear(x, plain), F.linear(x, plain))
    assert id(plain) not in matmul._PACKED
    half = nn.Parameter(w.half(), requires_grad=False)
    assert not onednn_packed(x.half())
    assert torch.equal(linear(x.half(), half), F.linear(x.half(), half))
    assert id(half) not in matmul._PACKED
    trained = nn.Parameter(w.clone())  # the demo trainer's weights need a gradient
    out = linear(x, trained)
    assert out.requires_grad and id(trained) not in matmul._PACKED


def test_the_dense_kernel_is_named_as_linear_chooses_it():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.ones(8, 16, dtype=dtype)
        widened = "float32, the bfloat16 weights widened a tile at a time"
        want = "oneDNN, weights packed once" if _packs(dtype) else widened if widens(x) else "F.linear"
        assert dense_kernel("cpu", dtype) == want
    assert dense_kernel("meta", torch.bfloat16) == "F.linear"


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_products_have_the_gradients_of_per_group_products(transposed):
    """The demo trainer differentiates the experts' grouped products (model/moe.py): an empty group
    gets a zero weight gradient, rows past the last group none."""
    if torch.float32 not in kernels.INSTALLED.cpu_grouped_mm:
        pytest.skip("this torch has no CPU grouped_mm")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 12, 8, generator=g)
    weight = nn.Parameter(w.transpose(1, 2).contiguous().transpose(1, 2) if transposed else w)
    x = torch.randn(40, 8, generator=g, requires_grad=True)
    ends = torch.tensor([8, 8, 32], dtype=torch.int32)
    up = torch.randn(32, 12, generator=g)
    (grouped_linear(x, weight, ends)[:32] * up).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(True), w.clone().requires_grad_(True)
    (torch.cat([xr[:8] @ wr[0].T, xr[8:32] @ wr[2].T]) * up).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(weight.grad, wr.grad)
    assert not x.grad[32:].any() and not weight.grad[1].any()
