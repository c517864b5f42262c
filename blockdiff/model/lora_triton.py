"""The segmented LoRA product (punica's shrink and expand) as two Triton kernels (triton 3.6): each
token reads only its own adapter's A and B, so the cost per token is one adapter's rank, not the
pool's (the plain torch product of model/lora.py computes every slot's columns and masks them).

Layout (model/lora.py LoRALinear, one mode): A [P*S*R, K] (adapter s of part p at rows
p*S*R + s*R), B [N, S*R] (adapter s at columns s*R of every part's rows), `part` [N] int32 the part
of each output row; the scale is folded into B. `index` [tokens] int64 names each token's slot, -1
for none: such a token's shrink is zeros and its output gets nothing added.

    shrink:  s[t, p*R:(p+1)*R] = x[t] @ A[p*S*R + index[t]*R : ... + R]^T
    expand:  y[t, o] += s[t, part[o]*R : ... + R] @ B[o, index[t]*R : ... + R]

One program computes one token's rank-R vector of one part (shrink), or one token's BLOCK_O output
columns (expand), in float32. Checked under Triton's interpreter (tests/model/test_lora_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64
BLOCK_O = 64


@triton.jit
def _shrink(x_ptr, a_ptr, idx_ptr, s_ptr, K, SR, P, R: tl.constexpr, RP: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)
    p = tl.program_id(1)
    slot = tl.load(idx_ptr + t)
    r = tl.arange(0, RP)
    acc = tl.zeros((RP,), dtype=tl.float32)
    if slot >= 0:
        rows = p * SR + slot * R + r
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            xk = tl.load(x_ptr + t * K + k, mask=k < K, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K),
                        other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(s_ptr + t * (P * R) + p * R + r, acc, mask=r < R)


@triton.jit
def _expand(s_ptr, b_ptr, idx_ptr, part_ptr, y_ptr, N, SRW, P, R: tl.constexpr, RP: tl.constexpr, BO: tl.constexpr):
    t = tl.program_id(0)
    o = tl.program_id(1) * BO + tl.arange(0, BO)
    slot = tl.load(idx_ptr + t)
    if slot >= 0:
        r = tl.arange(0, RP)
        live = (o[:, None] < N) & (r[None, :] < R)
        part = tl.load(part_ptr + o, mask=o < N, other=0)
        s = tl.load(s_ptr + t * (P * R) + part[:, None] * R + r[None, :], mask=live, other=0.0)
        b = tl.load(b_ptr + o[:, None] * SRW + slot * R + r[None, :], mask=live, other=0.0).to(tl.float32)
        delta = tl.sum(s * b, axis=1)
        y = tl.load(y_ptr + t * N + o, mask=o < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * N + o, (y + delta).to(y_ptr.dtype.element_ty), mask=o < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, index: torch.Tensor, parts: int, slots: int, rank: int) -> torch.Tensor:
    """x [T, K], a [P*S*R, K], index [T] -> s [T, P*R] float32."""
    x, a = x.contiguous(), a.contiguous()
    t, k = x.shape
    s = torch.empty(t, parts * rank, dtype=torch.float32, device=x.device)
    if t:
        _shrink[(t, parts)](x, a, index, s, k, slots * rank, parts, rank, triton.next_power_of_2(rank), BLOCK_K)
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, index: torch.Tensor, part: torch.Tensor,
                rank: int) -> torch.Tensor:
    """y [T, N] += the expand of s [T, P*R] through b [N, S*R]; in place, and returned."""
    assert y.is_contiguous()
    b = b.contiguous()
    t, n = y.shape
    if t:
        parts = s.shape[1] // rank
        _expand[(t, triton.cdiv(n, BLOCK_O))](s, b, index, part, y, n, b.shape[1], parts, rank,
                                              triton.next_power_of_2(rank), BLOCK_O)
    return y
