"""Weight-only integer products: x @ W.T where W is stored as small integers q with a scale (and,
for asymmetric schemes, a zero point) per output row and group of input columns:

    W[o, i] = (q[o, i] - zero[o, g[i]]) * scale[o, g[i]]

q is int8 in memory, 4-bit values included (signed: -8..7); g maps each input column to its
group (`group_index`). Where a weight's groups are contiguous runs of `group_size` columns (every
compressed-tensors scheme) g is the same for all its rows; GPTQ's act-order weights give each part
of a fused layer its own g, so the products take `segments`: runs of rows with their own g.

`int_linear` multiplies by one of two kernels, chosen by measurement (benchmarks/int_kernels.py,
docs/benchmarks.md "Integer weight-only products"):
- torch's own CPU weight-only kernels, where the weight's scheme fits one (`fast_kernel`) and the
  product has at most FAST_ROWS rows: `_weight_int8pack_mm` (int8, symmetric, one scale per row)
  and `_weight_int4pack_mm_for_cpu` (int4 in groups of 32-256, its packed copy of the weight made
  once per parameter, ops/matmul.py `packed_copy`). They read the integer weight once and never
  write a dequantized one: on the CPUs measured they beat the bfloat16 product at few rows;
- everything else dequantizes WIDEN_ELEMENTS weights at a time into a float32 tile and multiplies
  it, as ops/matmul.py widens bfloat16 weights, so no full-precision copy of a layer ever exists;
  the result is rounded to x's dtype once.
The two round differently (torch's kernels accumulate in x's dtype's own way), so a row's result
can change where its product crosses FAST_ROWS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdiff.ops.matmul import WIDEN_ELEMENTS, packed_copy

INT8_ROWS, INT4_GROUPS = "int8_rows", "int4_groups"  # torch's CPU weight-only kernels (`fast_kernel`)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu takes
INT4_ROW_MULTIPLE = 16  # its packing takes whole blocks of 16 output rows
# _weight_int8pack_mm reads past the end of bfloat16 rows whose width is no multiple of 16 on an EPYC
# with AVX512-BF16 (torch 2.13): garbage results at 72 or 100 columns, then a segfault.
INT8_COLUMN_MULTIPLE = 16
FAST_ROWS = 16  # products of up to this many rows take torch's kernels: they lost to bfloat16 from 32 rows (docs/benchmarks.md)
_FAST_DTYPES = (torch.bfloat16, torch.float32)


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


# (first row, end row, the rows' group_index, or None where their groups are contiguous runs of
# in / groups columns from column 0: one scale per row, or a shard cut on group boundaries)
Segments = list[tuple[int, int, torch.Tensor | None]]


def fast_kernel(bits: int, group_size: int | None, symmetric: bool, rows: int, columns: int, first: int) -> str | None:
    """torch's CPU kernel that multiplies a weight of this scheme held as `rows` x `columns` (the
    checkpoint's columns first..first+columns-1, all real), or None."""
    if bits == 8 and group_size is None and symmetric and columns % INT8_COLUMN_MULTIPLE == 0:
        return INT8_ROWS
    if (bits == 4 and group_size in INT4_GROUP_SIZES and columns % group_size == 0 and first % group_size == 0
            and rows % INT4_ROW_MULTIPLE == 0):
        return INT4_GROUPS
    return None


def _int4_packed(q: torch.Tensor) -> torch.Tensor:
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)


def _int4_scales(scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[groups, rows, 2]: each group's scale and the offset its zero point adds, as the kernel takes
    them (W = (q + 8 - 8) * scale + offset)."""
    offset = torch.zeros_like(scale) if zero is None else -zero * scale
    return torch.stack([scale.T, offset.T], dim=-1).to(dtype).contiguous()


def torch_kernel_linear(kernel: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W.T by torch's CPU `kernel` (`fast_kernel`), whatever the rows."""
    rows = x.reshape(-1, x.shape[-1])
    if kernel == INT8_ROWS:
        y = torch._weight_int8pack_mm(rows, q, scale[:, 0].to(x.dtype))
    else:
        packed = packed_copy(q, "int4pack", _int4_packed)
        packed = _int4_packed(q) if packed is None else packed
        scales = packed_copy(scale, f"int4scales_{x.dtype}", lambda s: _int4_scales(s, zero, x.dtype))
        scales = _int4_scales(scale, zero, x.dtype) if scales is None else scales
        y = torch._weight_int4pack_mm_for_cpu(rows, packed, q.shape[1] // scale.shape[1], scales)
    return y.reshape(*x.shape[:-1], q.shape[0])


def int_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               segments: Segments, kernel: str | None = None) -> torch.Tensor:
    """x [..., in] @ W.T: by torch's `kernel` (`fast_kernel`) on the CPU at up to FAST_ROWS rows,
    else W dequantized a tile of rows at a time, in float32 arithmetic (float64 for float64 x),
    rounded to x's dtype once."""
    if (kernel is not None and x.device.type == "cpu" and x.dtype in _FAST_DTYPES
            and x.numel() <= FAST_ROWS * x.shape[-1] and x.numel()):
        return torch_kernel_linear(kernel, x, q, scale, zero)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    out = x.new_empty(*x.shape[:-1], q.shape[0])
    step = max(1, WIDEN_ELEMENTS // max(q.shape[1], 1))
    for first, end, groups in segments:
        for a in range(first, end, step):
            b = min(a + step, end)
            z = None if zero is None else zero[a:b]
            if groups is None:
                out[..., a:b] = _aligned_tile(xf, q[a:b], scale[a:b], z)
                continue
            w = dequantize(q[a:b], scale[a:b], z, groups, compute)
            out[..., a:b] = F.linear(xf, w)
    return out


def _aligned_tile(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T for rows of W whose groups are contiguous runs of in / groups columns from column 0:
    the scales applied by broadcasting (per-channel ones to the product), the zero points as the
    product of each group's sum of x with zero * scale, so the tile is read twice at most."""
    rows, (n, k), g = x.shape[:-1], q.shape, scale.shape[1]
    if g == 1:
        y = F.linear(x, q.to(x.dtype)) * scale[:, 0].to(x.dtype)
    else:
        w = q.to(x.dtype).view(n, g, k // g).mul_(scale.to(x.dtype).unsqueeze(-1))
        y = F.linear(x, w.view(n, k))
    if zero is not None:
        sums = x.reshape(*rows, g, k // g).sum(-1)
        y = y - F.linear(sums, (zero * scale).to(x.dtype))
    return y
