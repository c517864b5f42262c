"""Paged attention as one Triton kernel (triton 3.6): every query row of a step, causal or
bidirectional, in one launch, reading K/V where they lie in the paged cache.

The work is cut into *tiles* of TILE consecutive query tokens of one sequence. A tile names
[table row, first token, token count, first own token, own token count]: its sequence's block
table row, and — for a canvas being denoised, whose K/V are not in the cache — the tokens of the
forward whose K/V are its own keys, all of them seen. Each query token carries the half-open range
[lo, hi) of cached positions it sees, so one launch mixes causal rows (hi = its position + 1, lo the
sliding window's start), canvases (lo the window's or 0, hi = the canvas start) and image spans.
One program computes one tile for one query head: it walks the cached positions of the tile's
union of ranges BLOCK_N at a time, maps each position through the block table to its cache entry
(blocks may sit anywhere and in any order; -1 marks one given back), then the own tokens, with a
float32 online softmax. No score matrix reaches memory; the keys are read in place.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Query tokens per tile (the metadata cuts sequences into tiles of this many) and per program.
# 16: the smallest product Triton's tl.dot takes, and what keeps a head-dim-512 tile in registers.
TILE = 16
# Fields of a tile: table row, first token, token count, first own token, own token count.
TILE_FIELDS = 5


# Triton 3.6's interpreter computes tl.dot of bfloat16 operands wrongly (garbage of order 1e10),
# so there the operands are widened to float32 first: a bfloat16 product is exact in float32, so the
# sums are those a GPU's bf16 products with float32 accumulation make, up to their order.
_WIDEN_UNDER_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _paged_attention(
    Q, K, V, KC, VC, KS, VS, Table, Tiles, Bounds, Out,
    sqt, sqh, skt, skh, svt, svh, skch, skce, svch, svce, stab, sot, soh,
    table_width, block_size,
    GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(Tiles + tile * 5)
    tok0 = tl.load(Tiles + tile * 5 + 1)
    count = tl.load(Tiles + tile * 5 + 2)
    own0 = tl.load(Tiles + tile * 5 + 3)
    own_len = tl.load(Tiles + tile * 5 + 4)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DIM
    row_ok = offs_m < count
    tokens = tok0 + offs_m
    q = tl.load(Q + tokens[:, None] * sqt + head * sqh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    lo = tl.load(Bounds + tokens * 2, mask=row_ok, other=2147483647)
    hi = tl.load(Bounds + tokens * 2 + 1, mask=row_ok, other=0)

    if FP8:  # the cache's scales, read on the device (no host sync)
        k_scale = tl.load(KS)
        v_scale = tl.load(VS)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Cached keys: the union of the tile's ranges, from a BLOCK_N-aligned start.
    first = tl.min(lo, 0) // BLOCK_N * BLOCK_N
    last = tl.max(hi, 0)
    for n0 in range(first, last, BLOCK_N):
        pos = n0 + offs_n
        col = pos // block_size
        block = tl.load(Table + seq * stab + col, mask=(pos < last) & (col < table_width), other=-1)
        key_ok = (pos < last) & (block >= 0)
        entry = block * block_size + pos % block_size
        kd = key_ok[:, None] & d_ok[None, :]
        k = tl.load(KC + kv_head * skch + entry[:, None] * skce + offs_d[None, :], mask=kd, other=0.0)
        if FP8:  # E4M3 widens exactly to q's dtype; the scale goes on the float32 products
            k = k.to(Q.dtype.element_ty)
        s = _dot(q, tl.trans(k), PRECISION, WIDEN)
        if FP8:
            s = s * k_scale
        seen = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None]) & key_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet stays at zero
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        v = tl.load(VC + kv_head * svch + entry[:, None] * svce + offs_d[None, :], mask=kd, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            v = v.to(Q.dtype.element_ty)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN) * v_scale
        else:
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
        m_i = m_new

    # A canvas's own keys, every one seen by every query of the canvas.
    for n0 in range(0, own_len, BLOCK_N):
        idx = n0 + offs_n
        key_ok = idx < own_len
        kd = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K + (own0 + idx)[:, None] * skt + kv_head * skh + offs_d[None, :], mask=kd, other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, WIDEN)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        v = tl.load(V + (own0 + idx)[:, None] * svt + kv_head * svh + offs_d[None, :], mask=kd, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + tokens[:, None] * sot + head * soh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _check_devices(q: torch.Tensor, *others: torch.Tensor) -> None:
    """The kernel takes raw pointers: a tensor on another device would be read as garbage (or, under
    fake tensors, not noticed at all), so every operand must sit on q's device."""
    for t in others:
        if t.device != q.device:
            raise RuntimeError(f"paged_attention: device mismatch, an operand on {t.device} with q on {q.device}")


@torch.library.custom_op("blockdiff::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    table: torch.Tensor, tiles: torch.Tensor, bounds: torch.Tensor, block_size: int,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention (scale 1) of q [tokens, heads, dim] over the paged cache k_cache / v_cache
    [kv heads, entries, dim] through `table` [rows, width] (block ids, -1 none) and the forward's
    own k / v [tokens, kv heads, dim], as `tiles` [tiles, 5] and `bounds` [tokens, 2] (int32) say
    (module docstring). -> [tokens, heads, dim]; a token in no tile is zero. An FP8 (float8_e4m3fn)
    cache needs k_scale and v_scale, float32 scalars on the device: an entry means entry x scale."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("paged_attention: an FP8 cache needs k_scale and v_scale")
    scales = (k_scale, v_scale) if fp8 else ()
    _check_devices(q, k, v, k_cache, v_cache, table, tiles, bounds, *scales)
    tokens, heads, dim = q.shape
    out = torch.zeros_like(q)
    if tiles.shape[0] == 0:
        return out
    kv_heads = k_cache.shape[0]
    for t in (q, k, v, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("paged_attention reads head dims with unit stride")
    block_d = triton.next_power_of_2(dim)
    block_n = 64 if block_d <= 256 else 32
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (tiles.shape[0], heads)
    _paged_attention[grid](
        q, k, v, k_cache, v_cache, *(scales or (q, q)), table, tiles, bounds, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), table.stride(0),
        out.stride(0), out.stride(1), table.shape[1], block_size,
        GROUP=heads // kv_heads, DIM=dim, BLOCK_D=block_d, BLOCK_M=TILE, BLOCK_N=block_n, PRECISION=precision,
        WIDEN=_WIDEN_UNDER_INTERPRETER and q.dtype != torch.float32, FP8=fp8,
        # Two stages: K and V tiles of a head dim 512 (32 KB each) double-buffered stay within a
        # Hopper SM's shared memory, where three would not.
        num_warps=4 if block_d <= 256 else 8, num_stages=2,
    )
    return out


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, table, tiles, bounds, block_size, k_scale=None, v_scale=None):
    _check_devices(q, k, v, k_cache, v_cache, table, tiles, bounds, *(t for t in (k_scale, v_scale) if t is not None))
    return torch.empty_like(q)
