"""What every attention backend reads: the rows of a forward, where their positions live in the
paged cache (`CacheGeometry`), which cached positions each query may see, and the per-step
metadata object that a backend builds and the model's attention layers call.

Tokens are packed [encoder tokens | decoder tokens | padding]. Encoder rows (a prompt chunk or a
finished canvas) write their K/V into the cache and then attend causally to the cached positions,
their own included; decoder rows (a canvas being denoised) attend bidirectionally to the cached
prefix and to their whole canvas and write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# Positions per key block of full-attention layers (rounded to whole cache blocks): big enough
# that the blocks' partial products stay small beside the scores (docs/benchmarks.md, "Attention").
KEY_BLOCK = 256
# Queries of an encoder row are attended in tiles of at most this many, each over the keys it
# reaches: the score block of one tile stays small, and a query's result does not depend on its tile.
QUERY_TILE = 512

# Token rows of a forward are padded to a multiple of this. CPU BLAS kernels compute a row the same
# way wherever it sits in a matmul whose row count is a multiple of 8, but tail rows another way;
# with the padding a request's numbers do not depend on its batch companions (the MoE's and the
# linears' products rely on it as much as the reference attention).
ROW_ALIGN = 8


def align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


# An FP8 KV cache (--kv-cache-dtype fp8): E4M3 entries, K / k_scale and V / v_scale clamped to its
# range, one scale each per layer (docs/fp8.md, "FP8 KV cache").
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0
# A layer's (k_scale, v_scale), float32 scalars on the device, where its cache is FP8; else None.
KVScales = tuple[torch.Tensor, torch.Tensor]


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as FP8 E4M3 (round to nearest), clamped to ±448 rather than cast to NaN."""
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


class KindAttention(Protocol):
    """One layer kind's (sliding or full) attention for one step, as a backend built it."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None

    def write(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
              scales: KVScales | None = None) -> None:
        """Stores the encoder tokens' K/V in the cache (before any row attends), quantized by
        `scales` where the cache is FP8."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
               scales: KVScales | None = None) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv heads, dim] -> [tokens, heads * dim] (scale 1).
        An FP8 cache's entries are read times `scales`; the forward's own k/v are used as they are."""


@dataclass
class AttentionMetadata:
    num_tokens: int  # packed [encoder | decoder | padding]
    num_encoder_tokens: int
    num_decoder_tokens: int
    positions: torch.Tensor  # [num_tokens]
    sliding: KindAttention | None
    full: KindAttention | None
    # A step that runs only some of its decoder rows (the fast denoising mode); None: every row runs.
    active: "ActiveRows | None" = None

    def kind(self, sliding: bool) -> KindAttention:
        return self.sliding if sliding else self.full


@dataclass
class ActiveRows:
    """The decoder rows a step runs when some canvas positions are settled (the fast denoising mode,
    docs/architecture.md "Fewer forwards"), and the K/V kept for the others.

    The backend's metadata is built for every decoder row (the `full` layout: [encoder | every decoder
    token | padding]); the model runs only the encoder tokens and the active decoder tokens. Around
    the backend, each attention layer widens its q/k/v to the full layout (a settled position's K/V:
    the one it had at the last step that computed it, from `kept`; its query: zeros, its output
    dropped) and narrows the output back, and keeps the active canvas tokens' fresh K/V. So any
    backend runs it unchanged, and an active row's result does not depend on which other rows run."""

    index: torch.Tensor  # [A] int64: the active tokens' places among the full layout's decoder tokens
    full_tokens: int  # tokens of the full layout, padded
    slot_rows: torch.Tensor  # [full decoder tokens] int64: each one's row of `kept` (slot * CL + position)
    store_src: torch.Tensor  # [S] int64: active tokens (among the A) of canvases, whose K/V are kept...
    store_dst: torch.Tensor  # [S] int64: ...at these rows of `kept`
    kept: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V [(slots + 1) * CL, kv heads, dim]
    layer: int = 0  # the layer running (the model's backbone sets it)

    def widen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ne: int) -> tuple[torch.Tensor, ...]:
        """q, k, v over [encoder | active | padding] tokens -> over the full layout; the active canvas
        tokens' k and v are kept for the steps in which they are settled."""
        out = []
        for i, x in enumerate((q, k, v)):
            full = x.new_zeros(self.full_tokens, *x.shape[1:])
            full[:ne] = x[:ne]
            dec = full[ne : ne + self.slot_rows.shape[0]]
            active = x[ne : ne + self.index.shape[0]]
            if i:
                kept = self.kept[self.layer][i - 1]
                dec.copy_(kept.index_select(0, self.slot_rows))
                kept.index_copy_(0, self.store_dst, active.index_select(0, self.store_src))
            dec.index_copy_(0, self.index, active)
            out.append(full)
        return tuple(out)

    def narrow(self, out: torch.Tensor, ne: int, num_tokens: int) -> torch.Tensor:
        """The attention output over the full layout -> over [encoder | active | padding] tokens."""
        small = out.new_zeros(num_tokens, *out.shape[1:])
        small[:ne] = out[:ne]
        small[ne : ne + self.index.shape[0]] = out[ne:].index_select(0, self.index)
        return small


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
    # The attention backend that builds the step's metadata and reads the cache
    # (model/attention_backends, chosen once at start-up by choose_attention_backend).
    backend: str = "reference"

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
class Piece:
    """The queries of one group row: a decoder row, or a tile of an encoder row."""

    row: int  # index among the step's rows
    token_start: int
    start: int  # position of the first query
    length: int
    key_lo: int  # the first cached position any of its queries sees
    key_end: int  # cached keys lie before this position
    spans: tuple[tuple[int, int], ...] = ()


def token_starts(rows: list[Row]) -> list[int]:
    out, offset = [], 0
    for r in rows:
        out.append(offset)
        offset += r.length
    return out


def pieces(i: int, r: Row, token_start: int, geo: CacheGeometry, sliding: bool) -> list[Piece]:
    if r.decoder:
        return [Piece(i, token_start, r.start, r.length, geo.past(sliding, r.start), r.start)]
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
        out.append(Piece(i, token_start + a, start, n, key_lo, key_end, spans))
    return out


def step_positions(rows: list[Row], device: torch.device | str) -> AttentionMetadata:
    """The step's packed token positions (padded to ROW_ALIGN), with no layer kind filled in yet."""
    offset = sum(r.length for r in rows)
    total = align(offset)
    positions = torch.zeros(total, dtype=torch.long)
    positions[:offset] = torch.cat([torch.arange(r.start, r.start + r.length) for r in rows])
    num_enc = sum(r.length for r in rows if not r.decoder)
    return AttentionMetadata(total, num_enc, offset - num_enc, positions.to(device), None, None)


def canvas_positions(starts: torch.Tensor, canvas_length: int) -> AttentionMetadata:
    """A step of canvases only: canvas r at positions starts[r]..+canvas_length, on the device."""
    rows = starts.shape[0]
    positions = (starts[:, None] + torch.arange(canvas_length, device=starts.device)).reshape(-1)
    return AttentionMetadata(rows * canvas_length, 0, rows * canvas_length, positions, None, None)


def flat(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The flat cache entry of each position of each (table) row."""
    return table[rows, positions // block_size] * block_size + positions % block_size


@dataclass(kw_only=True)
class WritesCache:
    """A backend's metadata of one layer kind, which writes the step's encoder K/V (`writes`, a
    CacheWrite or None) into the cache before any row attends; `cos` and `sin` are the step's
    rotary tables, which the model sets."""

    writes: "CacheWrite | None" = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
              scales: KVScales | None = None) -> None:
        if self.writes is not None:
            self.writes.apply(k, v, cache, scales)


@dataclass
class CacheWrite:
    """The encoder rows' cache writes of one layer kind: token `src[i]`'s K/V go to flat entry `dst[i]`."""

    src: torch.Tensor
    dst: torch.Tensor

    @staticmethod
    def of(rows: list[Row], starts: list[int], table: torch.Tensor, index: list[int], block_size: int,
           device: torch.device | str) -> CacheWrite | None:
        """Every new position of the encoder rows is written, sliding layers' included: a full block
        of them may be reused by a later request whose window reaches it (prefix caching). None: no
        encoder rows."""
        src, dst_rows, dst_pos = [], [], []
        for i, (r, s) in enumerate(zip(rows, starts)):
            if not r.decoder:
                src.append(torch.arange(s, s + r.length))
                dst_rows.append(torch.full((r.length,), index[i], dtype=torch.long))
                dst_pos.append(torch.arange(r.start, r.start + r.length))
        if not src:
            return None
        return CacheWrite(torch.cat(src).to(device),
                          flat(table, torch.cat(dst_rows).to(device), torch.cat(dst_pos).to(device), block_size))

    def apply(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
              scales: KVScales | None = None) -> None:
        for i, x in enumerate((k, v)):
            x = x.index_select(0, self.src).transpose(0, 1)
            store = cache[i]
            if scales is not None:  # the bytes: the CPU's index_copy_ has no float8 kernel
                store, x = store.view(torch.uint8), quantize_kv(x, scales[i]).view(torch.uint8)
            store.index_copy_(1, self.dst, x)


def step_tables(rows: list[Row], sliding: bool, device: torch.device | str,
                tables: dict[bool, torch.Tensor] | None) -> tuple[torch.Tensor, list[int]]:
    """The block table of a layer kind and each row's row in it: the rows' own tables (tables None)
    or the workers' per-slot ones, read at each row's slot."""
    if tables is None:
        return kind_tables(rows, sliding).to(device), list(range(len(rows)))
    return tables[sliding], [r.slot for r in rows]


def keep_kv(kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, dtype: torch.dtype,
            device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of the cache `kv` ([kv heads, entries, dim] each), K and V stores of `rows` canvas
    positions ((slots + 1) * CL): what ActiveRows keeps."""
    return [tuple(torch.zeros(rows, k.shape[0], k.shape[2], dtype=dtype, device=device) for _ in range(2))
            for k, _ in kv]


def run_active_rows(meta: AttentionMetadata, running: np.ndarray, slots: list[int], scored: int, scratch: int,
                    kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Narrow `meta` (built for every decoder row: `scored` scored tokens, then the canvases of
    `slots`) to the rows that run: every scored token and the canvas positions `running` [canvases,
    CL] bool; `scratch`: the slot whose kept rows a scored token points at (it always runs). The
    indices are made on the host, in numpy, from host data: no read of the device."""
    cl = running.shape[1]
    canvas = np.flatnonzero(running.reshape(-1)) + scored
    index = np.concatenate((np.arange(scored), canvas))
    slot_rows = np.concatenate((np.full(scored, scratch * cl), (np.asarray(slots)[:, None] * cl + np.arange(cl)).reshape(-1)))
    device = meta.positions.device
    on = lambda a: torch.tensor(a, dtype=torch.long, device=device)  # noqa: E731
    ne, n = meta.num_encoder_tokens, index.shape[0]
    positions = meta.positions.new_zeros(align(ne + n))
    positions[:ne] = meta.positions[:ne]
    positions[ne : ne + n] = meta.positions[ne:].index_select(0, on(index))
    meta.active = ActiveRows(on(index), meta.num_tokens, on(slot_rows), on(np.arange(scored, n)), on(slot_rows[canvas]), kept)
    meta.num_tokens, meta.num_decoder_tokens, meta.positions = positions.shape[0], n, positions
