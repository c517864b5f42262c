"""The vocabulary-parallel sampler's per-shard passes as Triton kernels (written for triton 3.6).

Each kernel reads this rank's logits [rows, local vocab] (float32, contiguous rows) in tiles of
`_CHUNKS` chunks of `chunk` columns and keeps only [rows]- or [rows, chunks]-sized results, so no
[rows, vocabulary] temporary exists; the collectives between them stay with the caller
(diffusion/vocab_parallel.py), which sees the same statistics as from its reference. Cumulative sums
are scanned inside one program per row in a fixed order (`tl.cumsum` over a tile plus a running
carry): no float cumsum, atomics or scatter that CUDA runs nondeterministically.

Every launch is a `torch.library.custom_op` with a registered fake, so FakeTensorMode and
torch.compile see its shapes without running it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from blockdiff.ops.sampler_weights import EXP_FLOOR

_CHUNKS = 8  # chunks per tile: a tile is 8 x 128 columns
_BLOCK = 1024  # columns per tile of the kernels that do not work by chunk
_SEARCH_BLOCK = 256  # columns per tile of the searches, which compare each against 16 thresholds
_PADDED = -1e30  # what a padding column becomes: finite, so exp gives 0 and 0 * it stays 0
_EXP_FLOOR = tl.constexpr(EXP_FLOOR)


@triton.jit
def _weight(y):
    """exp(y), 0 below EXP_FLOOR, as the reference's weights (ops/sampler_weights.py)."""
    return tl.where(y >= _EXP_FLOOR, tl.exp(y), 0.0)


@triton.jit
def _chunk_max_kernel(x_ptr, pad_ptr, out_ptr, V, CHUNKS_TOTAL, HAS_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      NC: tl.constexpr):
    row = tl.program_id(0)
    chunks = tl.program_id(1) * NC + tl.arange(0, NC)
    cols = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    inside = (cols < V) & (chunks[:, None] < CHUNKS_TOTAL)
    ptr = x_ptr + row.to(tl.int64) * V + cols
    x = tl.load(ptr, mask=inside, other=-float("inf"))
    if HAS_PAD:
        pad = tl.load(pad_ptr + cols, mask=inside, other=0) != 0
        x = tl.where(pad, _PADDED, x)
        tl.store(ptr, x, mask=inside & pad)
    tl.store(out_ptr + row.to(tl.int64) * CHUNKS_TOTAL + chunks, tl.max(x, axis=1), mask=chunks < CHUNKS_TOTAL)


@triton.jit
def _exp_statistics_kernel(x_ptr, m_ptr, cum_ptr, dot_ptr, V, CHUNKS_TOTAL, CHUNK: tl.constexpr, NC: tl.constexpr):
    row = tl.program_id(0)
    m = tl.load(m_ptr + row)
    carry = tl.zeros((), dtype=tl.float32)
    dot = tl.zeros((), dtype=tl.float32)
    for first in range(0, CHUNKS_TOTAL, NC):
        chunks = first + tl.arange(0, NC)
        cols = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        inside = cols < V
        ptr = x_ptr + row.to(tl.int64) * V + cols
        y = tl.load(ptr, mask=inside, other=0.0) - m
        tl.store(ptr, y, mask=inside)
        e = tl.where(inside, _weight(y), 0.0)
        sums = tl.sum(e, axis=1)
        tl.store(cum_ptr + row.to(tl.int64) * CHUNKS_TOTAL + chunks, carry + tl.cumsum(sums, axis=0),
                 mask=chunks < CHUNKS_TOTAL)
        carry += tl.sum(sums, axis=0)
        dot += tl.sum(tl.sum(e * y, axis=1), axis=0)
    tl.store(dot_ptr + row, dot)


@triton.jit
def _first_argmax_kernel(y_ptr, chunk_max_ptr, out_ptr, V, CHUNKS_TOTAL, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    best = tl.full((), -float("inf"), tl.float32)
    best_chunk = tl.zeros((), dtype=tl.int32)
    for first in range(0, CHUNKS_TOTAL, BLOCK):
        chunks = first + tl.arange(0, BLOCK)
        v = tl.load(chunk_max_ptr + row.to(tl.int64) * CHUNKS_TOTAL + chunks, mask=chunks < CHUNKS_TOTAL,
                    other=-float("inf"))
        top = tl.max(v, axis=0)
        at = first + tl.argmax(v, axis=0, tie_break_left=True)
        # strictly greater: an equal maximum in a later tile loses to the first (torch.argmax's ties)
        better = top > best
        best_chunk = tl.where(better, at, best_chunk)
        best = tl.where(better, top, best)
    cols = best_chunk * CHUNK + tl.arange(0, CHUNK)
    y = tl.load(y_ptr + row.to(tl.int64) * V + cols, mask=cols < V, other=-float("inf"))
    tl.store(out_ptr + row, best_chunk.to(tl.int64) * CHUNK + tl.argmax(y, axis=0, tie_break_left=True).to(tl.int64))


@triton.jit
def _inverse_cdf_kernel(y_ptr, cum_ptr, target_ptr, threshold_ptr, out_ptr, V, CHUNKS_TOTAL,
                        HAS_THRESHOLD: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cum_row = cum_ptr + row.to(tl.int64) * CHUNKS_TOTAL
    mass = tl.load(cum_row + CHUNKS_TOTAL - 1)
    # Strictly below the total (the float just under it), the chunk found holds mass.
    below_mass = tl.where(mass > 0, (mass.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), 0.0)
    target = tl.minimum(tl.load(target_ptr + row), below_mass)
    chunk = tl.zeros((), dtype=tl.int32)  # the chunks whose cumulative sum is <= target: searchsorted, right
    for first in range(0, CHUNKS_TOTAL, BLOCK):
        chunks = first + tl.arange(0, BLOCK)
        c = tl.load(cum_row + chunks, mask=chunks < CHUNKS_TOTAL, other=float("inf"))
        chunk += tl.sum((c <= target).to(tl.int32), axis=0)
    chunk = tl.minimum(chunk, CHUNKS_TOTAL - 1)
    before = tl.load(cum_row + tl.maximum(chunk - 1, 0))
    before = tl.where(chunk > 0, before, 0.0)
    lanes = tl.arange(0, CHUNK)
    cols = chunk * CHUNK + lanes
    values = tl.where(cols < V, _weight(tl.load(y_ptr + row.to(tl.int64) * V + cols, mask=cols < V, other=0.0)), 0.0)
    if HAS_THRESHOLD:
        values = tl.where(values >= tl.load(threshold_ptr + row), values, 0.0)
    pos = tl.sum((tl.cumsum(values, axis=0) <= target - before).to(tl.int32), axis=0)
    # The scan sums in another order than the chunk sums, which can run past the last token with weight.
    last = tl.max(tl.where(values > 0, lanes, 0), axis=0)
    tl.store(out_ptr + row, chunk.to(tl.int64) * CHUNK + tl.minimum(pos, last).to(tl.int64))


@triton.jit
def _count_at_least_kernel(y_ptr, t_ptr, out_ptr, V, K, KP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ks = tl.arange(0, KP)
    t = tl.load(t_ptr + row * K + ks, mask=ks < K, other=float("inf"))
    count = tl.zeros((KP,), dtype=tl.float32)
    for first in range(0, V, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        e = _weight(tl.load(y_ptr + row.to(tl.int64) * V + cols, mask=cols < V, other=-float("inf")))
        count += tl.sum((e[None, :] >= t[:, None]).to(tl.float32), axis=1)
    tl.store(out_ptr + row * K + ks, count, mask=ks < K)


@triton.jit
def _mass_above_kernel(y_ptr, t_ptr, floor_ptr, out_ptr, V, K, KP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ks = tl.arange(0, KP)
    t = tl.load(t_ptr + row * K + ks, mask=ks < K, other=float("inf"))
    floor = tl.load(floor_ptr + row)
    mass = tl.zeros((KP,), dtype=tl.float32)
    for first in range(0, V, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        e = _weight(tl.load(y_ptr + row.to(tl.int64) * V + cols, mask=cols < V, other=-float("inf")))
        kept = tl.where(e >= floor, e, 0.0)
        mass += tl.sum(tl.where(e[None, :] > t[:, None], kept[None, :], 0.0), axis=1)
    tl.store(out_ptr + row * K + ks, mass, mask=ks < K)


@triton.jit
def _kept_cumsum_kernel(y_ptr, t_ptr, cum_ptr, V, CHUNKS_TOTAL, CHUNK: tl.constexpr, NC: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(t_ptr + row)
    carry = tl.zeros((), dtype=tl.float32)
    for first in range(0, CHUNKS_TOTAL, NC):
        chunks = first + tl.arange(0, NC)
        cols = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
        e = _weight(tl.load(y_ptr + row.to(tl.int64) * V + cols, mask=cols < V, other=-float("inf")))
        sums = tl.sum(tl.where(e >= t, e, 0.0), axis=1)
        tl.store(cum_ptr + row.to(tl.int64) * CHUNKS_TOTAL + chunks, carry + tl.cumsum(sums, axis=0),
                 mask=chunks < CHUNKS_TOTAL)
        carry += tl.sum(sums, axis=0)


@triton.jit
def _exp_rows_kernel(y_ptr, index_ptr, out_ptr, V, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(index_ptr + i)
    y = tl.load(y_ptr + row * V + cols, mask=cols < V, other=0.0)
    tl.store(out_ptr + i.to(tl.int64) * V + cols, _weight(y).to(out_ptr.dtype.element_ty), mask=cols < V)


@triton.jit
def _gather_kernel(y_ptr, local_ptr, owned_ptr, out_ptr, V):
    row = tl.program_id(0)
    col = tl.load(local_ptr + row)
    owned = tl.load(owned_ptr + row) != 0
    value = tl.load(y_ptr + row.to(tl.int64) * V + col, mask=owned, other=0.0)
    tl.store(out_ptr + row, tl.where(owned, value, 0.0))


@triton.jit
def _scaled_exp_sum_kernel(y_ptr, index_ptr, scale_ptr, out_ptr, V, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(index_ptr + i)
    scale = tl.load(scale_ptr + i)
    total = tl.zeros((), dtype=tl.float32)
    for first in range(0, V, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + row * V + cols, mask=cols < V, other=-float("inf"))
        total += tl.sum(_weight(y * scale), axis=0)
    tl.store(out_ptr + i, total)


@triton.jit
def _row_cumsum_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    carry = tl.zeros((), dtype=tl.float32)
    for first in range(0, N, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * N + cols, mask=cols < N, other=0.0)
        tl.store(out_ptr + row.to(tl.int64) * N + cols, carry + tl.cumsum(x, axis=0), mask=cols < N)
        carry += tl.sum(x, axis=0)


def _chunks(v: int, chunk: int) -> int:
    return -(-v // chunk)


@torch.library.custom_op("blockdiff::sampler_chunk_max", mutates_args=("x",))
def chunk_max(x: torch.Tensor, padding: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """[rows, chunks] maxima per chunk of x [rows, V] float32, whose `padding` columns (bool [V], or
    None) are first set to -1e30 in place."""
    rows, v = x.shape
    out = x.new_empty(rows, _chunks(v, chunk))
    pad = padding if padding is not None else x  # not read without HAS_PAD
    grid = (rows, triton.cdiv(out.shape[1], _CHUNKS))
    _chunk_max_kernel[grid](x, pad, out, v, out.shape[1], HAS_PAD=padding is not None, CHUNK=chunk, NC=_CHUNKS)
    return out


@chunk_max.register_fake
def _(x, padding, chunk):
    return x.new_empty(x.shape[0], _chunks(x.shape[1], chunk))


@torch.library.custom_op("blockdiff::sampler_exp_statistics", mutates_args=("x",))
def exp_statistics(x: torch.Tensor, m: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, V] shifted in place by m [rows] into y = x - m; -> (the cumulative sums per chunk of
    exp(y) [rows, chunks], Σ exp(y)·y [rows])."""
    rows, v = x.shape
    cum, dot = x.new_empty(rows, _chunks(v, chunk)), x.new_empty(rows)
    _exp_statistics_kernel[(rows,)](x, m, cum, dot, v, cum.shape[1], CHUNK=chunk, NC=_CHUNKS)
    return cum, dot


@exp_statistics.register_fake
def _(x, m, chunk):
    return x.new_empty(x.shape[0], _chunks(x.shape[1], chunk)), x.new_empty(x.shape[0])


@torch.library.custom_op("blockdiff::sampler_first_argmax", mutates_args=())
def first_argmax(y: torch.Tensor, chunk_max: torch.Tensor, chunk: int) -> torch.Tensor:
    """[rows] int64 the first index of the maximum of y [rows, V], found in the first chunk whose
    maximum (`chunk_max` [rows, chunks]) is the row's."""
    out = y.new_empty(y.shape[0], dtype=torch.long)
    _first_argmax_kernel[(y.shape[0],)](y, chunk_max, out, y.shape[1], chunk_max.shape[1], CHUNK=chunk, BLOCK=_BLOCK)
    return out


@first_argmax.register_fake
def _(y, chunk_max, chunk):
    return y.new_empty(y.shape[0], dtype=torch.long)


@torch.library.custom_op("blockdiff::sampler_inverse_cdf", mutates_args=())
def inverse_cdf(y: torch.Tensor, cum: torch.Tensor, target: torch.Tensor, threshold: torch.Tensor | None,
                chunk: int) -> torch.Tensor:
    """[rows] int64 the first index where the running sum of the weights exp(y) (0 below `threshold`
    [rows] if given) passes `target` [rows], `cum` [rows, chunks] their cumulative chunk sums; never
    a token of weight 0."""
    out = y.new_empty(y.shape[0], dtype=torch.long)
    t = threshold if threshold is not None else target  # not read without HAS_THRESHOLD
    _inverse_cdf_kernel[(y.shape[0],)](y, cum, target, t, out, y.shape[1], cum.shape[1],
                                       HAS_THRESHOLD=threshold is not None, CHUNK=chunk, BLOCK=_BLOCK)
    return out


@inverse_cdf.register_fake
def _(y, cum, target, threshold, chunk):
    return y.new_empty(y.shape[0], dtype=torch.long)


@torch.library.custom_op("blockdiff::sampler_count_at_least", mutates_args=())
def count_at_least(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """[rows, thresholds] float32 how many weights exp(y) of each row reach each t [rows, thresholds]:
    one read of the row for all its thresholds."""
    out = torch.empty_like(t)
    k = t.shape[1]
    _count_at_least_kernel[(y.shape[0],)](y, t, out, y.shape[1], k, KP=triton.next_power_of_2(k), BLOCK=_SEARCH_BLOCK)
    return out


@count_at_least.register_fake
def _(y, t):
    return torch.empty_like(t)


@torch.library.custom_op("blockdiff::sampler_mass_above", mutates_args=())
def mass_above(y: torch.Tensor, t: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """[rows, thresholds] Σ of the weights e = exp(y) with e > t (each of t [rows, thresholds]) and
    e >= floor [rows]."""
    out = torch.empty_like(t)
    k = t.shape[1]
    _mass_above_kernel[(y.shape[0],)](y, t, floor, out, y.shape[1], k, KP=triton.next_power_of_2(k), BLOCK=_SEARCH_BLOCK)
    return out


@mass_above.register_fake
def _(y, t, floor):
    return torch.empty_like(t)


@torch.library.custom_op("blockdiff::sampler_kept_cumsum", mutates_args=())
def kept_cumsum(y: torch.Tensor, t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[rows, chunks] the cumulative chunk sums of the weights exp(y) that reach t [rows]."""
    cum = y.new_empty(y.shape[0], _chunks(y.shape[1], chunk))
    _kept_cumsum_kernel[(y.shape[0],)](y, t, cum, y.shape[1], cum.shape[1], CHUNK=chunk, NC=_CHUNKS)
    return cum


@kept_cumsum.register_fake
def _(y, t, chunk):
    return y.new_empty(y.shape[0], _chunks(y.shape[1], chunk))


@torch.library.custom_op("blockdiff::sampler_exp_rows", mutates_args=("out",))
def exp_rows(y: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = exp(y[index[i]]) in out's dtype: the unnormalised probabilities of some rows."""
    v = y.shape[1]
    _exp_rows_kernel[(index.shape[0], triton.cdiv(v, _BLOCK))](y, index, out, v, BLOCK=_BLOCK)


@exp_rows.register_fake
def _(y, index, out):
    return None


@torch.library.custom_op("blockdiff::sampler_gather", mutates_args=())
def gather(y: torch.Tensor, local: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """[rows] y[row, local[row]] where `owned` [rows] bool, else 0."""
    out = y.new_empty(y.shape[0])
    _gather_kernel[(y.shape[0],)](y, local, owned, out, y.shape[1])
    return out


@gather.register_fake
def _(y, local, owned):
    return y.new_empty(y.shape[0])


@torch.library.custom_op("blockdiff::sampler_scaled_exp_sum", mutates_args=())
def scaled_exp_sum(y: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[rows] Σ exp(scale[i] · y[index[i]]) over each row's columns (scale > 0)."""
    out = y.new_empty(index.shape[0])
    _scaled_exp_sum_kernel[(index.shape[0],)](y, index, scale, out, y.shape[1], BLOCK=_BLOCK)
    return out


@scaled_exp_sum.register_fake
def _(y, index, scale):
    return y.new_empty(index.shape[0])


@torch.library.custom_op("blockdiff::sampler_row_cumsum", mutates_args=())
def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] float32 running sums along each row of x, in one fixed order."""
    out = torch.empty_like(x)
    _row_cumsum_kernel[(x.shape[0],)](x, out, x.shape[1], BLOCK=min(_BLOCK, triton.next_power_of_2(max(1, x.shape[1]))))
    return out


@row_cumsum.register_fake
def _(x):
    return torch.empty_like(x)
