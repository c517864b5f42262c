"""The reference attention backend: exact on every device, tuned for the CPU, the numbers every
other backend is checked against.

It reads the paged cache in position order, in *key blocks* of a fixed number of positions aligned
to position 0 (`CacheGeometry.key_block`: whole cache blocks, 256 positions for full layers),
copied out of the cache a block at a time, and computes the softmax in a fixed structure with the
float32 scores in memory: the maximum over every key (exact in any order); each key block's Σexp
and Σexp·V as products of one fixed shape; the blocks' partial sums added in a fixed order — a
pairwise tree over block indices from position 0 for full layers, whose keys always start there,
and left to right for sliding layers, whose first key moves with the query. A masked key adds an
exact zero wherever it sits, so the result for a query does not depend on how its sequence was cut
into chunks, on which rows share its step, on how many padding keys or blocks its row carries, or
on whether the step is the eager mixed one or the static one: a prompt prefilled in one chunk or in
many, a prefix cached by another request and a recomputation after a preemption all write the same
K/V bits (`tests/model/test_attention.py`). Query rows are padded to a multiple of 8, where CPU BLAS
kernels compute a row the same way wherever it sits.

Rows of the same mode, query length and key-block count form one group: one batched product per
KV head. `ReferenceKind` holds the groups of one layer kind for one step; mixed steps build it from
the rows (`build_metadata`), steps of canvases only build it on the device with fixed shapes
(`canvas_metadata`), so that such a step compiles whole and replays as a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdiff.model.attention_layout import (FP8_KV_DTYPE, AttentionMetadata, CacheGeometry, CacheWrite, KVScales,
                                              Piece, Row, WritesCache, align, canvas_positions, pieces, step_positions,
                                              step_tables, token_starts)
from blockdiff.ops.matmul import widens

NAME = "reference"


@dataclass
class AttnGroup:
    """Rows of one mode and shape: [rows, q_len] queries over `blocks` key blocks of cached keys each
    (and, for canvases, their own canvas after them)."""

    rows: int
    q_len: int
    token_start: int  # the rows' tokens are contiguous from here on...
    gather: torch.Tensor | None  # ...unless this [rows * q_len] token index is given
    canvas: bool  # decoder rows: the row's new tokens are keys too, after the cached ones
    blocks: int  # key blocks of cached keys per row (0: none)
    cache_blocks: torch.Tensor | None  # [rows * blocks * key_block / block_size] cache block ids, position order
    mask: torch.Tensor | None  # [rows, blocks, align(q_len) or 1, key_block] bool: which cached keys a query sees
    tree: bool  # the blocks' sums as a pairwise tree (keys from position 0), else left to right


@dataclass
class ReferenceKind(WritesCache):
    """Everything one layer kind (sliding or full) needs for one step: its groups and the encoder
    rows' cache writes (done before any row attends)."""

    groups: list[AttnGroup]
    key_block: int
    block_size: int

    def attend(self, q, k, v, cache: tuple[torch.Tensor, torch.Tensor], scales: KVScales | None = None) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv heads, dim] -> [tokens, heads * dim]; an FP8
        cache's entries times `scales`."""
        n, heads, dim = q.shape
        g = self.groups[0]
        if len(self.groups) == 1 and g.gather is None and g.rows * g.q_len == n:
            return _attend(q, k, v, g, cache, self.key_block, self.block_size, scales).reshape(n, -1)
        out = q.new_zeros(n, heads * dim)  # padding rows stay zero
        for g in self.groups:
            o = _attend(q, k, v, g, cache, self.key_block, self.block_size, scales).reshape(g.rows * g.q_len, -1)
            if g.gather is None:
                out[g.token_start : g.token_start + g.rows * g.q_len] = o
            else:
                out[g.gather] = o
        return out


def _rows(t: torch.Tensor, g: AttnGroup) -> torch.Tensor:
    """[tokens, heads, dim] -> [rows, q_len, heads, dim] for the group."""
    if g.gather is None:
        t = t[g.token_start : g.token_start + g.rows * g.q_len]
    else:
        t = t.index_select(0, g.gather)
    return t.view(g.rows, g.q_len, *t.shape[1:])


def _by_kv_head(t: torch.Tensor) -> torch.Tensor:
    """[rows, tokens, kv heads, dim] -> [kv heads, rows, tokens, dim]."""
    return t.permute(2, 0, 1, 3)


def _cached(cache: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache blocks `block_ids` of one layer's K or V ([kv heads, entries, dim]), in order:
    [kv heads, len(block_ids) * block_size, dim], one copy of whole blocks."""
    kv, entries, dim = cache.shape
    if cache.dtype == FP8_KV_DTYPE:  # its bytes: not every device's index_select takes float8
        return _cached(cache.view(torch.uint8), block_ids, block_size).view(FP8_KV_DTYPE)
    return cache.view(kv, entries // block_size, block_size * dim).index_select(1, block_ids).view(kv, -1, dim)


def _products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, k] @ b [..., k, n] as one batched product of contiguous [m, k] and [k, n] matrices.
    CPU BLAS computes an element of such a product the same way whatever the batch count, but a
    transposed or strided operand takes other kernels whose results change with it
    (tests/model/test_attention.py). Where bfloat16 products run in float32 (ops/matmul.py
    `widens`), so do these, and the result stays float32: every caller widens it anyway."""
    lead = a.shape[:-2]
    if widens(a):
        a, b = a.float(), b.float()
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]).contiguous(), b.reshape(-1, *b.shape[-2:]).contiguous())
    return out.view(*lead, *out.shape[-2:])


def _tree(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` as a pairwise tree over the indices (a missing partner is zero): zero
    entries past the last non-zero one never change it."""
    while x.shape[dim] > 1:
        if x.shape[dim] % 2:
            pad = list(x.shape)
            pad[dim] = 1
            x = torch.cat((x, x.new_zeros(pad)), dim)
        pairs = x.unflatten(dim, (-1, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x.squeeze(dim)


def _fold(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` left to right: zero entries before the first non-zero one or after the
    last never change it."""
    total = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        total = total + x.select(dim, i)
    return total


def _exp_minus(x: torch.Tensor, m: torch.Tensor, seen: torch.Tensor | None = None, group: int = 1) -> torch.Tensor:
    """exp(x - m), in place. With `seen` (1 or 0 per key, broadcasting against x [kv, rows, blocks,
    group * M, keys] viewed as [kv, rows, blocks, group, M, keys]) x holds -inf at the unseen keys:
    those are exponentiated as 0 and multiplied by 0 instead, the same bits, as the CPU's exp takes
    a path ~2x slower for inputs below float32's range."""
    y = x.sub_(m)
    if seen is None:
        return y.exp_()
    shape = (*x.shape[:3], group, -1, x.shape[-1])
    y.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0).exp_().view(shape).mul_(seen)
    return y


def _attend(q, k, v, g: AttnGroup, cache: tuple[torch.Tensor, torch.Tensor], key_block: int,
            block_size: int, scales: KVScales | None = None) -> torch.Tensor:
    """Attention of one group (scale 1); returns [rows, q_len, heads, dim]. An FP8 cache's entries
    are widened to q's dtype (exactly: E4M3 fits in bfloat16, float16 and float32) and their
    scales applied to the float32 products, q·k x k_scale and Σ p·v x v_scale."""
    qs = _rows(q, g)
    rows, length, heads, dim = qs.shape
    kv = cache[0].shape[0]
    group = heads // kv
    padded = align(length)
    if padded != length:
        qs = torch.cat((qs, qs.new_zeros(rows, padded - length, heads, dim)), 1)
    # The query heads of each KV head stacked into one product: [kv heads, rows, group * padded, dim].
    stacked = qs.view(rows, padded, kv, group, dim).permute(2, 0, 3, 1, 4).reshape(kv, rows, group * padded, dim)
    # Reduced-precision products, float32 statistics (as SDPA's kernels keep them).
    acc = torch.float32 if qs.dtype in (torch.bfloat16, torch.float16) else qs.dtype
    m = scores = canvas = None
    if g.blocks:
        # [kv, rows, blocks, key_block, dim] -> each block's keys as a [dim, key_block] operand
        keys = _cached(cache[0], g.cache_blocks, block_size).view(kv, rows, g.blocks, key_block, dim)
        keys = keys.transpose(-1, -2).to(qs.dtype).contiguous()
        queries = stacked.unsqueeze(2).expand(kv, rows, g.blocks, *stacked.shape[2:])
        scores = _products(queries, keys).to(acc)  # [kv, rows, blocks, M, key_block]
        if scales is not None:
            scores.mul_(scales[0])
        # Over the query heads of a KV head. A 0 / -inf bias, not a broadcast masked_fill_ (~15x
        # slower on CPU): the same scores; the max over the keys first, then the blocks, as fast.
        seen = g.mask[None, :, :, None]
        bias = torch.where(seen, 0.0, float("-inf")).to(acc)
        scores.view(kv, rows, g.blocks, group, -1, key_block).add_(bias)
        m = scores.amax(-1).amax(2)
    if g.canvas:
        own_k, own_v = _by_kv_head(_rows(k, g)), _by_kv_head(_rows(v, g))
        canvas = _products(stacked, own_k.transpose(-1, -2)).to(acc)  # [kv, rows, M, q_len]
        m = canvas.amax(-1) if m is None else torch.maximum(m, canvas.amax(-1))
    total = out = None
    if g.blocks:
        # The unseen keys zeroed after the exp where exp is slow on -inf (the CPU); elsewhere exp(-inf).
        e = _exp_minus(scores, m[:, :, None, :, None], seen.to(acc) if scores.is_cpu else None, group)
        values = _cached(cache[1], g.cache_blocks, block_size).view(kv, rows, g.blocks, key_block, dim).to(qs.dtype)
        reduce = _tree if g.tree else _fold
        total, out = reduce(e.sum(-1), 2), reduce(_products(e.to(values.dtype), values).to(acc), 2)
        if scales is not None:
            out = out * scales[1]
    if g.canvas:
        e = _exp_minus(canvas, m[..., None])
        own_total, own_out = e.sum(-1), _products(e.to(own_v.dtype), own_v).to(acc)
        total, out = (own_total, own_out) if total is None else (total + own_total, out + own_out)
    out = (out / total.unsqueeze(-1)).to(qs.dtype)
    return out.view(kv, rows, group, padded, dim).permute(1, 3, 0, 2, 4)[:, :length].reshape(rows, length, heads, dim)


def build_metadata(rows: list[Row], geometry: CacheGeometry, kinds: set[bool], device: torch.device | str,
                   tables: dict[bool, torch.Tensor] | None = None) -> AttentionMetadata:
    """Metadata for one forward over `rows` (encoder rows first). `kinds` holds the layer kinds
    present (True: sliding). `tables`: the block tables per layer kind, [slots + 1, width] on the
    device, read at each row's slot; None: each row's own (`Row.blocks`, `Row.sliding_blocks`)."""
    starts = token_starts(rows)
    meta = step_positions(rows, device)
    for sliding in kinds:
        table, index = step_tables(rows, sliding, device, tables)
        kb = geometry.key_block(sliding)
        ps = [p for i, r in enumerate(rows) for p in pieces(i, r, starts[i], geometry, sliding)]
        shapes: dict[tuple[bool, int, int], list[Piece]] = {}
        for p in ps:
            r = rows[p.row]
            blocks = -(-p.key_end // kb) - p.key_lo // kb if p.key_end > p.key_lo else 0
            shapes.setdefault((r.decoder, p.length, blocks), []).append(p)
        groups = [_group(group, [index[p.row] for p in group], key, table, geometry, sliding, device)
                  for key, group in shapes.items()]
        kind = ReferenceKind(groups, kb, geometry.block_size,
                             writes=CacheWrite.of(rows, starts, table, index, geometry.block_size, device))
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta


def _group(pieces: list[Piece], table_rows: list[int], shape: tuple, table: torch.Tensor, geo: CacheGeometry,
           sliding: bool, device) -> AttnGroup:
    decoder, length, blocks = shape
    n = len(pieces)
    token_starts = [p.token_start for p in pieces]
    contiguous = all(token_starts[i] == token_starts[0] + i * length for i in range(n))
    gather = None
    if not contiguous:
        gather = (torch.tensor(token_starts)[:, None] + torch.arange(length)[None, :]).reshape(-1).to(device)
    group = AttnGroup(n, length, token_starts[0], gather, decoder, blocks, None, None, not sliding)
    if blocks:
        kb = geo.key_block(sliding)
        first = torch.tensor([p.key_lo // kb * kb for p in pieces])
        lo = torch.tensor([p.key_lo for p in pieces])
        end = torch.tensor([p.key_end for p in pieces])
        keys = first[:, None] + torch.arange(blocks * kb)  # [pieces, keys] positions
        valid = (keys >= lo[:, None]) & (keys < end[:, None])
        if decoder:
            mask = valid[:, None, :]
        else:
            q = torch.tensor([p.start for p in pieces])[:, None] + torch.arange(align(length)).clamp(max=length - 1)
            dist = q[:, :, None] - keys[:, None, :]
            if geo.encoder_causal:
                allowed = dist >= 0
                if sliding:
                    allowed &= dist < geo.window
            else:
                allowed = dist.abs() <= geo.window if sliding else torch.ones_like(dist, dtype=torch.bool)
            for i, p in enumerate(pieces):
                for a, b in p.spans:
                    inside_q = (q[i] >= a) & (q[i] < b)
                    inside_k = (keys[i] >= a) & (keys[i] < b)
                    allowed[i] |= inside_q[:, None] & inside_k[None, :]
            mask = valid[:, None, :] & allowed
        group.mask = mask.view(n, mask.shape[1], blocks, kb).transpose(1, 2).contiguous().to(device)
        group.cache_blocks = _block_ids(table, torch.tensor(table_rows, device=table.device), first.to(table.device),
                                        blocks * kb, geo.block_size)
    return group


def _block_ids(table: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, keys: int, block_size: int) -> torch.Tensor:
    """[rows * keys / block_size] the cache blocks holding positions first[r] .. + keys of each
    table row (block 0 where the table has none: those keys are masked)."""
    cols = (first // block_size)[:, None] + torch.arange(keys // block_size, device=table.device)
    ids = table.index_select(0, rows).gather(1, cols.clamp(max=table.shape[1] - 1))
    return ids.clamp(min=0).reshape(-1)


def canvas_metadata(starts: torch.Tensor, tables: dict[bool, torch.Tensor], canvas_length: int, context: int,
                    geometry: CacheGeometry) -> AttentionMetadata:
    """Metadata for a step of canvases only, built on the device with no host sync: canvas r sits
    at positions starts[r]..+canvas_length and reads the cached positions before it through its
    block table tables[sliding][r] ([canvases, blocks], -1 for a given-back sliding block). Every
    canvas gets the same number of key blocks: enough for `context` positions (full layers; at
    least every start), or for the window (sliding layers), masked where it has fewer."""
    rows = starts.shape[0]
    meta = canvas_positions(starts, canvas_length)
    for sliding, table in tables.items():
        kb = geometry.key_block(sliding)
        blocks = -(-context // kb)
        if sliding:
            blocks = min(blocks, -(-(geometry.window_past + kb - 1) // kb))
        group = AttnGroup(rows, canvas_length, 0, None, True, blocks, None, None, not sliding)
        if blocks:
            lo = (starts - geometry.window_past).clamp(min=0) if sliding else torch.zeros_like(starts)
            first = lo // kb * kb
            keys = first[:, None] + torch.arange(blocks * kb, device=starts.device)
            valid = (keys >= lo[:, None]) & (keys < starts[:, None])
            group.mask = valid.view(rows, blocks, 1, kb)
            group.cache_blocks = _block_ids(table, torch.arange(rows, device=starts.device), first, blocks * kb,
                                            geometry.block_size)
        kind = ReferenceKind([group], kb, geometry.block_size)
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta
