"""Weight-only integer products: x @ W.T where W is stored as small integers q with a scale (and,
for asymmetric schemes, a zero point) per output row and group of input columns:

    W[o, i] = (q[o, i] - zero[o, g[i]]) * scale[o, g[i]]

q is int8 in memory, 4-bit values included (signed: -8..7); g maps each input column to its
group (`group_index`). Where a weight's groups are contiguous runs of `group_size` columns (every
compressed-tensors scheme) g is the same for all its rows; GPTQ's act-order weights give each part
of a fused layer its own g, so the products take `segments`: runs of rows with their own g.

`int_linear` dequantizes WIDEN_ELEMENTS weights at a time into a float32 tile and multiplies it,
as ops/matmul.py widens bfloat16 weights, so no full-precision copy of a layer ever exists; the
result is rounded to x's dtype once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdiff.ops.matmul import WIDEN_ELEMENTS


def unpack_int32(packed: torch.Tensor, bits: int, n: int, dim: int = -1) -> torch.Tensor:
    """int32 words holding 32 / bits values each along `dim`, lowest bits first, stored with an
    offset of 2^(bits-1) (compressed-tensors' and GPTQ's packing) -> the first n values along
    `dim`, as signed int8."""
    per, mask, offset = 32 // bits, (1 << bits) - 1, 1 << (bits - 1)
    p = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=p.device)
    values = ((p.unsqueeze(-1) >> shifts) & mask).reshape(*p.shape[:-1], p.shape[-1] * per)[..., :n]
    return (values - offset).to(torch.int8).movedim(-1, dim)


def regular_groups(start: int, n: int, group_size: int | None, device=None) -> torch.Tensor:
    """The group of each of input columns start..start+n-1 with contiguous groups of group_size
    (None: one group, per-channel scales), counted from the group of column `start`."""
    if group_size is None:
        return torch.zeros(n, dtype=torch.long, device=device)
    cols = torch.arange(start, start + n, device=device)
    return cols // group_size - start // group_size


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_index: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [..., out, in] in `dtype` from q [..., out, in], scale / zero [..., out, groups] and
    group_index [in]."""
    s = scale.to(dtype).index_select(-1, group_index)
    w = q.to(dtype)
    if zero is not None:
        w = w - zero.to(dtype).index_select(-1, group_index)
    return w * s


Segments = list[tuple[int, int, torch.Tensor]]  # (first row, end row, the rows' group_index)


def int_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               segments: Segments) -> torch.Tensor:
    """x [..., in] @ W.T, W dequantized a tile of rows at a time; float32 arithmetic (float64 for
    float64 x), rounded to x's dtype once."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    out = x.new_empty(*x.shape[:-1], q.shape[0])
    step = max(1, WIDEN_ELEMENTS // max(q.shape[1], 1))
    for first, end, groups in segments:
        for a in range(first, end, step):
            b = min(a + step, end)
            w = dequantize(q[a:b], scale[a:b], None if zero is None else zero[a:b], groups, compute)
            out[..., a:b] = F.linear(xf, w)
    return out
