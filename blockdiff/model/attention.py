"""Attention in both modes over a mixed batch, reading the paged KV cache in position order, and the
per-step metadata that drives it.

A forward pass holds rows of two modes. Encoder rows (a prompt chunk or a finished canvas) write
their K/V into the cache and then attend causally to the cached positions, their own included;
decoder rows (a canvas being denoised) attend bidirectionally to the cached prefix and to their
whole canvas and write nothing. Tokens are packed [encoder tokens | decoder tokens].

**A query's result depends on its own keys only.** Keys are read from the cache a block at a time
in position order, in *key blocks* of a fixed number of positions aligned to position 0
(`CacheGeometry.key_block`: whole cache blocks, 256 positions for full layers), and the softmax
is computed in a fixed structure: the maximum over every key (exact in any order); each key
block's Σexp and Σexp·V as products of one fixed shape; the blocks' partial sums added in a fixed
order — a pairwise tree over block indices from position 0 for full layers, whose keys always
start there, and left to right for sliding layers, whose first key moves with the query. A masked
key adds an exact zero wherever it sits, so the result for a query does not depend on how its
sequence was cut into chunks, on which rows share its step, on how many padding keys or blocks
its row carries, or on whether the step is the eager mixed one or the static one: a prompt
prefilled in one chunk or in many, a prefix cached by another request and a recomputation after
a preemption all write the same K/V bits (`tests/test_attention.py`). Query rows are padded to a
multiple of 8, where CPU BLAS kernels compute a row the same way wherever it sits.

Rows of the same mode, query length and key-block count form one group: one batched product per
KV head. `KindMetadata` holds the groups of one layer kind for one step; mixed steps build it from
the rows (`build_metadata`), steps of canvases only build it on the device with fixed shapes
(`canvas_metadata`), so that such a step compiles whole and replays as a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockdiff.model.gemma_config import GemmaConfig, LayerSpec
from blockdiff.model.layers import RMSNorm, apply_rotary, unit_rms
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.layers import column_parallel, row_parallel
from blockdiff.quantization import covering

# Positions per key block of full-attention layers (rounded to whole cache blocks): big enough
# that the blocks' partial products stay small beside the scores (docs/benchmarks.md, "Attention").
KEY_BLOCK = 256
# Queries of an encoder row are attended in tiles of at most this many, each over the keys it
# reaches: the score block of one tile stays small, and a query's result does not depend on its tile.
QUERY_TILE = 512

# Token rows of a forward are padded to a multiple of this. CPU BLAS kernels compute a row the same
# way wherever it sits in a matmul whose row count is a multiple of 8, but tail rows another way;
# with the padding a request's numbers do not depend on its batch companions.
ROW_ALIGN = 8


def align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


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
class KindMetadata:
    """Everything one layer kind (sliding or full) needs for one step: its groups and the encoder
    rows' cache writes (done before any row attends)."""

    groups: list[AttnGroup]
    key_block: int
    block_size: int
    write_src: torch.Tensor | None = None  # encoder tokens whose K/V are stored...
    write_dst: torch.Tensor | None = None  # ...at these flat cache positions
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def attend(self, q, k, v, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv heads, dim] -> [tokens, heads * dim]."""
        n, heads, dim = q.shape
        g = self.groups[0]
        if len(self.groups) == 1 and g.gather is None and g.rows * g.q_len == n:
            return _attend(q, k, v, g, cache, self.key_block, self.block_size).reshape(n, -1)
        out = q.new_zeros(n, heads * dim)  # padding rows stay zero
        for g in self.groups:
            o = _attend(q, k, v, g, cache, self.key_block, self.block_size).reshape(g.rows * g.q_len, -1)
            if g.gather is None:
                out[g.token_start : g.token_start + g.rows * g.q_len] = o
            else:
                out[g.gather] = o
        return out

    def write(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.write_dst is not None:
            cache[0].index_copy_(1, self.write_dst, k.index_select(0, self.write_src).transpose(0, 1))
            cache[1].index_copy_(1, self.write_dst, v.index_select(0, self.write_src).transpose(0, 1))


@dataclass
class AttentionMetadata:
    num_tokens: int  # packed [encoder | decoder | padding]
    num_encoder_tokens: int
    num_decoder_tokens: int
    positions: torch.Tensor  # [num_tokens]
    sliding: KindMetadata | None
    full: KindMetadata | None

    def kind(self, sliding: bool) -> KindMetadata:
        return self.sliding if sliding else self.full


def qkv_parts(config: GemmaConfig, spec: LayerSpec, group: TPGroup) -> list[tuple[int, int, int]]:
    """Row ranges of q, k (and v) owned by this rank. KV heads are split when there are at least as
    many as ranks, else each rank holds the one KV head its query heads use."""
    heads, kv, hd = config.num_heads, spec.num_kv_heads, spec.head_dim
    if heads % group.size:
        raise ValueError(f"{heads} attention heads cannot be split over {group.size} ranks")
    local_heads = heads // group.size
    if kv % group.size == 0:
        local_kv, kv_start = kv // group.size, group.rank * (kv // group.size)
    elif group.size % kv == 0:
        local_kv, kv_start = 1, (group.rank * local_heads) // (heads // kv)
    else:
        raise ValueError(f"{kv} KV heads cannot be split or replicated over {group.size} ranks")
    q = (heads * hd, local_heads * hd, group.rank * local_heads * hd)
    k = (kv * hd, local_kv * hd, kv_start * hd)
    return [q, k, k] if spec.has_v_proj else [q, k]


class Attention(nn.Module):
    def __init__(self, config: GemmaConfig, spec: LayerSpec, group: TPGroup, dtype: torch.dtype, prefix: str):
        """`prefix`: the checkpoint's name of this module, which the quantization_config's patterns match."""
        super().__init__()
        self.spec = spec
        parts = qkv_parts(config, spec, group)
        self.head_dim = spec.head_dim
        self.local_heads = parts[0][1] // spec.head_dim
        self.local_kv_heads = parts[1][1] // spec.head_dim
        qkv = [f"{prefix}.{n}_proj" for n in "qkv"[: len(parts)]]
        self.qkv_proj = column_parallel(config.hidden_size, parts, dtype, covering(config.quantization, *qkv))
        self.o_proj = row_parallel(
            config.num_heads * spec.head_dim, config.hidden_size, group, dtype, covering(config.quantization, f"{prefix}.o_proj")
        )
        self.q_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, dtype=dtype)
        self.v_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        kind = meta.kind(self.spec.sliding)
        n = x.shape[0]
        # q, k and v are normalised per head: one rms over all the heads of the projection (the
        # same bits per head), k's also giving v where the layer has no v_proj.
        unit = unit_rms(self.qkv_proj(x).view(n, -1, self.head_dim), self.q_norm.eps)
        h, kv = self.local_heads, self.local_kv_heads
        q = self.q_norm.scaled(unit[:, :h], x.dtype)
        k = self.k_norm.scaled(unit[:, h : h + kv], x.dtype)
        v = self.v_norm.scaled(unit[:, h + kv :] if self.spec.has_v_proj else unit[:, h : h + kv], x.dtype)
        q = apply_rotary(q, kind.cos, kind.sin)
        k = apply_rotary(k, kind.cos, kind.sin)

        kind.write(k, v, cache)  # first: an encoder row's queries read their own keys from the cache
        return self.o_proj(kind.attend(q, k, v, cache))


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
    return cache.view(kv, entries // block_size, block_size * dim).index_select(1, block_ids).view(kv, -1, dim)


def _products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, k] @ b [..., k, n] as one batched product of contiguous [m, k] and [k, n] matrices.
    CPU BLAS computes an element of such a product the same way whatever the batch count, but a
    transposed or strided operand takes other kernels whose results change with it
    (tests/test_attention.py)."""
    lead = a.shape[:-2]
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
    """exp(x - m): in place when nothing differentiates through x (the max taken of x keeps x for
    its gradient, so training, the demo trainer's, needs a new tensor). With `seen` (1 or 0 per
    key, broadcasting against x [kv, rows, blocks, group * M, keys] viewed as [kv, rows, blocks,
    group, M, keys]) x holds -inf at the unseen keys: those are exponentiated as 0 and multiplied
    by 0 instead, the same bits, as the CPU's exp takes a path ~2x slower for inputs below
    float32's range."""
    y = x - m if x.requires_grad else x.sub_(m)
    if seen is None:
        return y.exp() if x.requires_grad else y.exp_()
    shape = (*x.shape[:3], group, -1, x.shape[-1])
    if x.requires_grad:
        return (y.nan_to_num(nan=float("nan"), posinf=float("inf"), neginf=0.0).exp().view(shape) * seen).view(x.shape)
    y.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0).exp_().view(shape).mul_(seen)
    return y


def _attend(q, k, v, g: AttnGroup, cache: tuple[torch.Tensor, torch.Tensor], key_block: int,
            block_size: int) -> torch.Tensor:
    """Attention of one group (scale 1); returns [rows, q_len, heads, dim]."""
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
        keys = keys.transpose(-1, -2).contiguous()
        queries = stacked.unsqueeze(2).expand(kv, rows, g.blocks, *stacked.shape[2:])
        scores = _products(queries, keys).to(acc)  # [kv, rows, blocks, M, key_block]
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
        values = _cached(cache[1], g.cache_blocks, block_size).view(kv, rows, g.blocks, key_block, dim)
        reduce = _tree if g.tree else _fold
        total, out = reduce(e.sum(-1), 2), reduce(_products(e.to(values.dtype), values).to(acc), 2)
    if g.canvas:
        e = _exp_minus(canvas, m[..., None])
        own_total, own_out = e.sum(-1), _products(e.to(own_v.dtype), own_v).to(acc)
        total, out = (own_total, own_out) if total is None else (total + own_total, out + own_out)
    out = (out / total.unsqueeze(-1)).to(qs.dtype)
    return out.view(kv, rows, group, padded, dim).permute(1, 3, 0, 2, 4)[:, :length].reshape(rows, length, heads, dim)


@dataclass
class Row:
    """One sequence's part of a forward pass."""

    slot: int  # the request's slot (per-request state of the worker: denoising state, block tables)
    start: int  # tokens already in the cache = position of the first new token
    length: int  # new tokens: a prompt chunk, a canvas to commit, or a canvas to denoise
    decoder: bool
    # Full-attention cache blocks of the request, in order. Only where the caller keeps no block
    # tables of its own (`build_metadata(tables=None)`): the engine's workers keep them per slot.
    blocks: tuple[int, ...] = ()
    # Sliding-layer blocks, in order; -1 where a block is out of every query's window and was
    # given back. None: the same table as `blocks` (a cache with as many sliding blocks as full ones).
    sliding_blocks: tuple[int, ...] | None = None
    # [start, end) positions among the new tokens whose tokens attend to each other both ways (the
    # soft tokens of one image, where the checkpoint asks for it); the rest stays causal.
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class CacheGeometry:
    """Where a position of a request lives in the flat cache storage, and how attention reads it."""

    block_size: int  # both layer kinds: paged blocks, one block table per kind
    window_past: int  # sliding layers read the last `window_past` cached positions (window - 1)
    window: int | None  # sliding window, the query itself included
    encoder_causal: bool = True

    def key_block(self, sliding: bool) -> int:
        """Positions per key block of a layer kind: whole cache blocks, KEY_BLOCK for full layers,
        no more than the window for sliding ones."""
        want = min(KEY_BLOCK, self.window) if sliding and self.window else KEY_BLOCK
        return self.block_size * max(1, -(-want // self.block_size))

    def past(self, sliding: bool, start: int) -> int:
        """The first cached position a canvas at `start` sees."""
        return max(0, start - self.window_past) if sliding else 0


def kind_tables(rows: list[Row], sliding: bool) -> torch.Tensor:
    """The rows' own block tables of one layer kind, [rows, longest] int64 (-1 padding)."""
    lists = [r.sliding_blocks if sliding and r.sliding_blocks is not None else r.blocks for r in rows]
    table = torch.full((len(rows), max(1, max(len(t) for t in lists))), -1, dtype=torch.long)
    for i, t in enumerate(lists):
        if t:
            table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return table


@dataclass
class _Piece:
    """The queries of one group row: a decoder row, or a tile of an encoder row."""

    row: int  # index among the step's rows
    token_start: int
    start: int  # position of the first query
    length: int
    key_lo: int  # the first cached position any of its queries sees
    key_end: int  # cached keys lie before this position
    spans: tuple[tuple[int, int], ...] = ()


def build_metadata(rows: list[Row], geometry: CacheGeometry, kinds: set[bool], device: torch.device | str,
                   tables: dict[bool, torch.Tensor] | None = None) -> AttentionMetadata:
    """Metadata for one forward over `rows` (encoder rows first). `kinds` holds the layer kinds
    present (True: sliding). `tables`: the block tables per layer kind, [slots + 1, width] on the
    device, read at each row's slot; None: each row's own (`Row.blocks`, `Row.sliding_blocks`)."""
    token_starts, offset = [], 0
    for r in rows:
        token_starts.append(offset)
        offset += r.length
    total = align(offset)
    positions = torch.zeros(total, dtype=torch.long)
    positions[:offset] = torch.cat([torch.arange(r.start, r.start + r.length) for r in rows])
    num_enc = sum(r.length for r in rows if not r.decoder)
    meta = AttentionMetadata(total, num_enc, offset - num_enc, positions.to(device), None, None)
    for sliding in kinds:
        if tables is None:
            table, index = kind_tables(rows, sliding).to(device), list(range(len(rows)))
        else:
            table, index = tables[sliding], [r.slot for r in rows]
        kb = geometry.key_block(sliding)
        pieces = [p for i, r in enumerate(rows) for p in _pieces(i, r, token_starts[i], geometry, sliding)]
        shapes: dict[tuple[bool, int, int], list[_Piece]] = {}
        for p in pieces:
            r = rows[p.row]
            blocks = -(-p.key_end // kb) - p.key_lo // kb if p.key_end > p.key_lo else 0
            shapes.setdefault((r.decoder, p.length, blocks), []).append(p)
        groups = [_group(group, [index[p.row] for p in group], key, table, geometry, sliding, device)
                  for key, group in shapes.items()]
        kind = KindMetadata(groups, kb, geometry.block_size)
        # Every new position is written, sliding layers' included: a full block of them may be
        # reused by a later request whose window reaches it (prefix caching).
        src, dst_rows, dst_pos = [], [], []
        for i, (r, s) in enumerate(zip(rows, token_starts)):
            if not r.decoder:
                src.append(torch.arange(s, s + r.length))
                dst_rows.append(torch.full((r.length,), index[i], dtype=torch.long))
                dst_pos.append(torch.arange(r.start, r.start + r.length))
        if src:
            kind.write_src = torch.cat(src).to(device)
            kind.write_dst = _flat(table, torch.cat(dst_rows).to(device), torch.cat(dst_pos).to(device),
                                   geometry.block_size)
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta


def _flat(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat cache entry of each position of each (table) row."""
    return table[rows, positions // block_size] * block_size + positions % block_size


def _pieces(i: int, r: Row, token_start: int, geo: CacheGeometry, sliding: bool) -> list[_Piece]:
    if r.decoder:
        return [_Piece(i, token_start, r.start, r.length, geo.past(sliding, r.start), r.start)]
    end = r.start + r.length
    out = []
    for a in range(0, r.length, QUERY_TILE):
        start, n = r.start + a, min(QUERY_TILE, r.length - a)
        spans = tuple((lo, hi) for lo, hi in r.bidirectional if lo < start + n and hi > start)
        if geo.encoder_causal:
            key_end = max([start + n] + [hi for _, hi in spans])
            key_lo = max(0, start - geo.window + 1) if sliding else 0
        else:  # each query sees its whole chunk (and, sliding, the window before it)
            key_end = end
            key_lo = max(0, start - geo.window) if sliding else 0
        out.append(_Piece(i, token_start + a, start, n, key_lo, key_end, spans))
    return out


def _group(pieces: list[_Piece], table_rows: list[int], shape: tuple, table: torch.Tensor, geo: CacheGeometry,
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
    steps = torch.arange(canvas_length, device=starts.device)
    positions = (starts[:, None] + steps).reshape(-1)
    meta = AttentionMetadata(rows * canvas_length, 0, rows * canvas_length, positions, None, None)
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
        kind = KindMetadata([group], kb, geometry.block_size)
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta
