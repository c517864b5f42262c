"""The Triton attention backend (CUDA): one kernel launch per layer over every row of the step,
reading the paged cache in place through the block tables (blockdiff/ops/triton_attention.py).

Its metadata is the kernel's: the block table, the tiles of query tokens (one sequence each) and
each query token's range of cached positions [lo, hi). A causal row's query at position p sees
[p - window + 1, p + 1) on a sliding layer and [0, p + 1) on a full one; a canvas at `start` sees
[start - (window - 1), start) or [0, start), plus its whole canvas from the forward's own K/V;
an image span widens the range of its queries to the span. These are the reference's masks
(attention_backends/reference.py), each a single range per query, so the two agree key for key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdiff.model.attention_layout import (AttentionMetadata, CacheGeometry, CacheWrite, KVScales, Piece, Row,
                                              WritesCache, canvas_positions, pieces, step_positions, step_tables, token_starts)
from blockdiff.ops.triton_attention import TILE, paged_attention

NAME = "triton"


@dataclass
class TritonKind(WritesCache):
    """One layer kind's kernel arguments for one step."""

    table: torch.Tensor  # [table rows, width] block ids, -1 none
    tiles: torch.Tensor  # [tiles, 5] int32: table row, first token, count, first own token, own count
    bounds: torch.Tensor  # [tokens, 2] int32: [lo, hi) cached positions each query token sees
    block_size: int

    def attend(self, q, k, v, cache: tuple[torch.Tensor, torch.Tensor], scales: KVScales | None = None) -> torch.Tensor:
        """q [tokens, heads, dim], k/v [tokens, kv heads, dim] -> [tokens, heads * dim]; an FP8
        cache's entries times `scales`."""
        out = paged_attention(q, k, v, cache[0], cache[1], self.table, self.tiles, self.bounds, self.block_size,
                              *(scales or ()))
        return out.flatten(1)


def _ranges(p: Piece, decoder: bool, geo: CacheGeometry, sliding: bool) -> torch.Tensor:
    """[p.length, 2] the cached positions [lo, hi) each query of a piece sees."""
    if decoder:
        return torch.tensor([[p.key_lo, p.key_end]]).expand(p.length, 2)
    q = torch.arange(p.start, p.start + p.length)
    w = geo.window
    if geo.encoder_causal:
        lo, hi = (q - w + 1 if sliding else torch.zeros_like(q)), q + 1
    else:
        lo = q - w if sliding else torch.zeros_like(q)
        hi = q + w + 1 if sliding else torch.full_like(q, p.key_end)
    for a, b in p.spans:  # the span and the window both hold the query: their union is one range
        inside = (q >= a) & (q < b)
        lo = torch.where(inside, lo.clamp(max=a), lo)
        hi = torch.where(inside, hi.clamp(min=b), hi)
    return torch.stack((lo.clamp(min=p.key_lo), hi.clamp(max=p.key_end)), 1)


def build_metadata(rows: list[Row], geometry: CacheGeometry, kinds: set[bool], device: torch.device | str,
                   tables: dict[bool, torch.Tensor] | None = None) -> AttentionMetadata:
    """As reference.build_metadata: one forward over `rows` (encoder rows first)."""
    starts = token_starts(rows)
    meta = step_positions(rows, device)
    for sliding in kinds:
        table, index = step_tables(rows, sliding, device, tables)
        bounds = torch.zeros(meta.num_tokens, 2, dtype=torch.int32)
        tiles = []
        for i, r in enumerate(rows):
            for p in pieces(i, r, starts[i], geometry, sliding):
                bounds[p.token_start : p.token_start + p.length] = _ranges(p, r.decoder, geometry, sliding)
                own = (starts[i], r.length) if r.decoder else (0, 0)
                tiles += [(index[i], t, min(TILE, p.token_start + p.length - t), *own)
                          for t in range(p.token_start, p.token_start + p.length, TILE)]
        kind = TritonKind(table, torch.tensor(tiles, dtype=torch.int32).view(-1, 5).to(device), bounds.to(device),
                          geometry.block_size, writes=CacheWrite.of(rows, starts, table, index, geometry.block_size, device))
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta


def canvas_metadata(starts: torch.Tensor, tables: dict[bool, torch.Tensor], canvas_length: int, context: int,
                    geometry: CacheGeometry) -> AttentionMetadata:
    """As reference.canvas_metadata, on the device with no host sync. The kernel reads each
    canvas's own prefix length, so `context` (the reference's fixed key-block count) is not needed."""
    rows, cl = starts.shape[0], canvas_length
    device = starts.device
    meta = canvas_positions(starts, cl)
    per = -(-cl // TILE)
    t = torch.arange(rows * per, device=device)
    seq, j = t // per, t % per
    tiles = torch.stack((seq, seq * cl + j * TILE, (cl - j * TILE).clamp(max=TILE), seq * cl,
                         torch.full_like(seq, cl)), 1).to(torch.int32)
    for sliding, table in tables.items():
        lo = (starts - geometry.window_past).clamp(min=0) if sliding else torch.zeros_like(starts)
        bounds = torch.stack((lo, starts), 1).to(torch.int32)[:, None].expand(rows, cl, 2).reshape(rows * cl, 2)
        kind = TritonKind(table, tiles, bounds, geometry.block_size)
        if sliding:
            meta.sliding = kind
        else:
            meta.full = kind
    return meta
