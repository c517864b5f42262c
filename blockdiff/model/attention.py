"""Attention in both modes over a mixed batch, and the per-step metadata that drives it.

A forward pass holds rows of two modes. Encoder rows (a prompt chunk or a finished canvas) attend
causally to the cache and to themselves and append their K/V to the cache; decoder rows (a canvas
being denoised) attend bidirectionally to the cached prefix and to the whole canvas and write
nothing. Tokens are packed [encoder tokens | decoder tokens]. For attention, rows of the same mode
and the same shape (new tokens, cached tokens) form one SDPA batch with no padding at all, so a
row's result never depends on the rows it shares the step with. The keys of a row are [its own new
tokens | its cached tokens]; masks come from positions and are shared by the rows of a group.

That is one of two kinds of per-layer-kind metadata behind one seam (`attend`, `write`): the other,
`CanvasKind`, serves steps of canvases only with fixed shapes built on the device
(`canvas_metadata`), so that the step can be compiled whole and replayed as a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.model.gemma_config import GemmaConfig, LayerSpec
from blockdiff.matmul import linear, onednn_float32
from blockdiff.model.layers import RMSNorm, apply_rotary
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.layers import column_parallel, row_parallel
from blockdiff.quantization import covering

# SDPA broadcasts KV heads over query groups itself from torch 2.5 on.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class AttnGroup:
    """Rows of one mode and one shape: [rows, q_len] queries over [rows, q_len + cached] keys."""

    rows: int
    q_len: int
    token_start: int  # the rows' tokens are contiguous from here on...
    gather: torch.Tensor | None  # ...unless this [rows * q_len] token index is given
    cache_index: torch.Tensor | None  # [rows, cached] flat index into the layer kind's cache
    mask: torch.Tensor | None  # [1, 1, q_len, q_len + cached] bool; None: attend to every key


@dataclass
class KindMetadata:
    """Everything one layer kind (sliding or full) needs for one step of mixed rows: rows grouped
    by mode and shape, each group one SDPA batch with no padding, and the encoder rows' cache writes.
    Built in Python per step (build_metadata); the eager path of every step that is not all canvases."""

    groups: list[AttnGroup]
    write_src: torch.Tensor | None  # encoder tokens whose K/V are stored...
    write_dst: torch.Tensor | None  # ...at these flat cache positions
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def attend(self, q, k, v, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv heads, dim] -> [tokens, heads * dim]."""
        n, heads, dim = q.shape
        g = self.groups[0]
        if len(self.groups) == 1 and g.gather is None and g.rows * g.q_len == n:
            return _attend(q, k, v, g, *cache).reshape(n, -1)
        out = q.new_zeros(n, heads * dim)  # padding rows stay zero
        for g in self.groups:
            o = _attend(q, k, v, g, *cache).reshape(g.rows * g.q_len, -1)
            if g.gather is None:
                out[g.token_start : g.token_start + g.rows * g.q_len] = o
            else:
                out[g.gather] = o
        return out

    def write(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        if self.write_dst is not None:
            cache[0][self.write_dst] = k[self.write_src]
            cache[1][self.write_dst] = v[self.write_src]


@dataclass
class CanvasKind:
    """One layer kind's metadata for a step of canvases only (the static step): every canvas
    attends to itself and to a fixed number of prefix keys, masked where the canvas has fewer.
    Device tensors of fixed shape built on the device (canvas_metadata), no cache writes."""

    rows: int  # canvases
    cache_index: torch.Tensor | None  # [canvases, past] flat cache positions; None: no prefix keys
    key_mask: torch.Tensor | None  # [canvases, 1, 1, canvas + past] bool
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def attend(self, q, k, v, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n, heads, dim = q.shape
        qs, ks, vs = (t.view(self.rows, n // self.rows, *t.shape[1:]) for t in (q, k, v))
        if self.cache_index is not None:
            ks = torch.cat((ks, _cached(cache[0], self.cache_index)), dim=1)
            vs = torch.cat((vs, _cached(cache[1], self.cache_index)), dim=1)
        return _sdpa(qs, ks, vs, self.key_mask).reshape(n, heads * dim)

    def write(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Canvases being denoised write nothing."""


# Token rows of a forward are padded to a multiple of this. CPU BLAS kernels compute a row the same
# way wherever it sits in a matmul whose row count is a multiple of 8, but tail rows another way;
# with the padding a request's numbers do not depend on its batch companions.
ROW_ALIGN = 8


def align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass
class AttentionMetadata:
    num_tokens: int  # packed [encoder | decoder | padding]
    num_encoder_tokens: int
    num_decoder_tokens: int
    positions: torch.Tensor  # [num_tokens]
    sliding: KindMetadata | CanvasKind | None
    full: KindMetadata | CanvasKind | None

    def kind(self, sliding: bool) -> KindMetadata | CanvasKind:
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
        self.splits = [p[1] for p in parts]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        kind = meta.kind(self.spec.sliding)
        n = x.shape[0]
        qkv = self.qkv_proj(x).split(self.splits, dim=-1)
        q = self.q_norm(qkv[0].view(n, self.local_heads, self.head_dim))
        k_raw = qkv[1].view(n, self.local_kv_heads, self.head_dim)
        v = self.v_norm(qkv[2].view(n, self.local_kv_heads, self.head_dim) if self.spec.has_v_proj else k_raw)
        k = self.k_norm(k_raw)
        q = apply_rotary(q, kind.cos, kind.sin)
        k = apply_rotary(k, kind.cos, kind.sin)

        out = kind.attend(q, k, v, cache)
        kind.write(k, v, cache)
        return self.o_proj(out)


def _rows(t: torch.Tensor, g: AttnGroup) -> torch.Tensor:
    """[tokens, heads, dim] -> [rows, q_len, heads, dim] for the group."""
    if g.gather is None:
        t = t[g.token_start : g.token_start + g.rows * g.q_len]
    else:
        t = t.index_select(0, g.gather)
    return t.view(g.rows, g.q_len, *t.shape[1:])


def _cached(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] for a [rows, cached] index, as one row gather (index_select copies whole
    [heads, dim] rows; advanced indexing computes an offset per element, ~5x slower on CPU)."""
    return cache.index_select(0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])


# On oneDNN's float32 path attention runs as two products per (row, KV head), 1.3-1.9x faster than
# PyTorch's CPU flash-attention kernel (whose tiles go through MKL's sgemm) at canvas shapes
# (docs/benchmarks.md). Its [queries, keys] score block is materialised, so past this many
# elements the tiled SDPA kernel runs instead. The choice depends on the row's own shape only.
_MAX_SCORES = 1 << 22


def _attend(q, k, v, g: AttnGroup, k_cache, v_cache) -> torch.Tensor:
    """Attention over one group; returns [rows, q_len, heads, dim]."""
    qs, ks, vs = _rows(q, g), _rows(k, g), _rows(v, g)
    if g.cache_index is not None:
        ks = torch.cat((ks, _cached(k_cache, g.cache_index)), dim=1)
        vs = torch.cat((vs, _cached(v_cache, g.cache_index)), dim=1)
    if onednn_float32(qs) and qs.shape[2] // ks.shape[2] * g.q_len * ks.shape[1] <= _MAX_SCORES:
        return _attend_products(qs, ks, vs, g.mask)
    return _sdpa(qs, ks, vs, g.mask)


def _sdpa(qs, ks, vs, mask: torch.Tensor | None) -> torch.Tensor:
    """PyTorch's SDPA (scale 1) on [rows, tokens, heads, dim] operands."""
    qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
    extra = {}
    if qs.shape[1] != ks.shape[1]:
        if _SDPA_HAS_GQA:
            extra["enable_gqa"] = True
        else:
            rep = qs.shape[1] // ks.shape[1]
            ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=1.0, **extra)
    return out.transpose(1, 2)


def _attend_products(qs, ks, vs, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(Q K^T) V (scale 1) with the query heads of each KV head stacked into one product:
    qs [rows, q_len, heads, dim], ks/vs [rows, keys, kv heads, dim] -> [rows, q_len, heads, dim]."""
    rows, q_len, heads, dim = qs.shape
    kv = ks.shape[2]
    group = heads // kv
    stacked = qs.view(rows, q_len, kv, group, dim).permute(0, 2, 3, 1, 4).reshape(rows, kv, group * q_len, dim)
    # Dense [keys, dim] blocks per (row, KV head): oneDNN falls back to a slow reference kernel
    # on operands with gaps between rows.
    ks, vs = ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()
    blocked = None if mask is None else ~mask[0, 0].repeat(group, 1)
    out = torch.empty_like(stacked)
    for r in range(rows):
        for h in range(kv):
            scores = linear(stacked[r, h], ks[r, h])
            if blocked is not None:
                scores.masked_fill_(blocked, float("-inf"))
            out[r, h] = linear(scores.softmax(-1), vs[r, h].t())
    return out.view(rows, kv, group, q_len, dim).permute(0, 3, 1, 2, 4).reshape(rows, q_len, heads, dim)


@dataclass
class Row:
    """One sequence's part of a forward pass."""

    slot: int  # the request's slot (per-request denoising state of the worker)
    start: int  # tokens already in the cache = position of the first new token
    length: int  # new tokens: a prompt chunk, a canvas to commit, or a canvas to denoise
    decoder: bool
    blocks: tuple[int, ...] = ()  # full-attention cache blocks of the request, in order
    # Sliding-layer blocks, in order; -1 where a block is out of every query's window and was
    # given back. None: the same table as `blocks` (a cache with as many sliding blocks as full ones).
    sliding_blocks: tuple[int, ...] | None = None
    # [start, end) positions among the new tokens whose tokens attend to each other both ways (the
    # soft tokens of one image, where the checkpoint asks for it); the rest stays causal.
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class CacheGeometry:
    """Where a position of a request lives in the flat cache storage."""

    block_size: int  # both layer kinds: paged blocks, one block table per kind
    window_past: int  # sliding layers read the last `window_past` cached positions (window - 1)
    window: int | None  # sliding window, the query itself included
    encoder_causal: bool = True

    def block_index(self, blocks: tuple[int, ...], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(blocks, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def index(self, row: Row, positions: torch.Tensor, sliding: bool) -> torch.Tensor:
        table = row.sliding_blocks if sliding and row.sliding_blocks is not None else row.blocks
        return self.block_index(table, positions)


def build_metadata(
    rows: list[Row], geometry: CacheGeometry, kinds: set[bool], device: torch.device | str
) -> AttentionMetadata:
    """Index tensors and masks for one forward over `rows` (encoder rows first). `kinds` holds the
    layer kinds present (True: sliding)."""
    starts, offset = [], 0
    for r in rows:
        starts.append(offset)
        offset += r.length
    total = align(offset)
    positions = torch.zeros(total, dtype=torch.long)
    positions[:offset] = torch.cat([torch.arange(r.start, r.start + r.length) for r in rows])
    num_enc = sum(r.length for r in rows if not r.decoder)
    meta = AttentionMetadata(total, num_enc, offset - num_enc, positions.to(device), None, None)
    for sliding in kinds:
        shapes: dict[tuple[bool, int, int], list[int]] = {}
        for i, r in enumerate(rows):
            cached = min(r.start, geometry.window_past) if sliding else r.start
            spans = tuple((a - r.start, b - r.start) for a, b in r.bidirectional)
            shapes.setdefault((r.decoder, r.length, cached, spans), []).append(i)
        groups = [
            _group([rows[i] for i in idx], [starts[i] for i in idx], key, geometry, sliding, device)
            for key, idx in shapes.items()
        ]
        # Every new position is written, sliding layers' included: a full block of them may be
        # reused by a later request whose window reaches it (prefix caching).
        src, dst = [], []
        for r, s in zip(rows, starts):
            if r.decoder:
                continue
            src.append(torch.arange(s, s + r.length))
            dst.append(geometry.index(r, torch.arange(r.start, r.start + r.length), sliding))
        write_src = torch.cat(src).to(device) if src else None
        write_dst = torch.cat(dst).to(device) if dst else None
        kind = KindMetadata(groups, write_src, write_dst)
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta


def _group(rows: list[Row], token_starts: list[int], shape: tuple, geo: CacheGeometry, sliding: bool, device) -> AttnGroup:
    decoder, q_len, cached, spans = shape
    n = len(rows)
    contiguous = all(token_starts[i] == token_starts[0] + i * q_len for i in range(n))
    gather = None
    if not contiguous:
        gather = (torch.tensor(token_starts)[:, None] + torch.arange(q_len)[None, :]).reshape(-1).to(device)
    cache_index = None
    if cached:
        index = torch.stack([geo.index(r, torch.arange(r.start - cached, r.start), sliding) for r in rows])
        cache_index = index.to(device)
    mask = None
    if not decoder:
        # Keys are [new tokens | cached tokens]; positions relative to the first new token.
        q_pos = torch.arange(q_len)
        k_pos = torch.cat((q_pos, torch.arange(-cached, 0)))
        dist = q_pos[:, None] - k_pos[None, :]
        if geo.encoder_causal:
            allowed = dist >= 0
            if sliding:
                allowed &= dist < geo.window
        else:
            allowed = dist.abs() <= geo.window if sliding else torch.ones_like(dist, dtype=torch.bool)
        for a, b in spans:
            allowed[a:b, a:b] = True
        mask = allowed[None, None].to(device)
    return AttnGroup(rows=n, q_len=q_len, token_start=token_starts[0], gather=gather, cache_index=cache_index, mask=mask)


def canvas_metadata(
    starts: torch.Tensor, tables: dict[bool, torch.Tensor], canvas_length: int, context: int, geometry: CacheGeometry
) -> AttentionMetadata:
    """Metadata for a step of canvases only, built on the device with no host sync: canvas r sits
    at positions starts[r]..+canvas_length and reads the cached positions before it through its
    block table tables[sliding][r] ([canvases, blocks], -1 for a given-back sliding block). Each
    canvas gets the same number of prefix keys, `context` (full layers; at least every start) or
    min(context, window_past) (sliding layers), masked where it has fewer."""
    rows = starts.shape[0]
    steps = torch.arange(canvas_length, device=starts.device)
    positions = (starts[:, None] + steps).reshape(-1)
    meta = AttentionMetadata(rows * canvas_length, 0, rows * canvas_length, positions, None, None)
    for sliding, table in tables.items():
        past = min(context, geometry.window_past) if sliding else context
        kind = CanvasKind(rows, None, None)
        if past:
            pos = starts[:, None] - past + torch.arange(past, device=starts.device)
            valid = pos >= 0
            pos = pos.clamp(min=0)
            block = table.gather(1, pos // geometry.block_size).clamp(min=0)
            kind.cache_index = block * geometry.block_size + pos % geometry.block_size
            canvas = torch.ones(rows, canvas_length, dtype=torch.bool, device=starts.device)
            kind.key_mask = torch.cat((canvas, valid), dim=1)[:, None, None, :]
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta
