"""KV cache storage, its size, and where a position lives in it.

Full-attention layers keep every committed position, in fixed-size blocks handed out per request.
Sliding layers only ever need the last `window - 1` positions, so each request slot owns a ring of
that many entries per sliding layer, whatever the length of the request.
"""

from __future__ import annotations

import torch

from blockdiff.config import EngineConfig
from blockdiff.model.attention import CacheGeometry
from blockdiff.model.interface import BlockDiffusionModel
from blockdiff.step import CacheConfig


def _bytes(model: BlockDiffusionModel, sliding: bool, positions: int) -> int:
    size = torch.tensor([], dtype=model.dtype).element_size()
    return sum(2 * positions * s.kv_heads * s.head_dim * size for s in model.kv_cache_spec() if s.sliding == sliding)


def cache_bytes_per_block(model: BlockDiffusionModel, block_size: int) -> int:
    return _bytes(model, False, block_size)


def ring_bytes_per_slot(model: BlockDiffusionModel, ring: int) -> int:
    return _bytes(model, True, ring)


def ring_size(model: BlockDiffusionModel, max_model_len: int) -> int:
    """Positions a sliding layer keeps per slot: the window's past, or the whole sequence if shorter."""
    window = model.config.sliding_window
    return max(1, min(window - 1, max_model_len)) if window else 1


def size_cache(model: BlockDiffusionModel, cfg: EngineConfig, max_model_len: int) -> CacheConfig:
    """The cache `cfg` asks for, sized on a built (rank's) model, so per-rank head counts are right."""
    per_block = cache_bytes_per_block(model, cfg.block_size)
    rings = ring_bytes_per_slot(model, ring_size(model, max_model_len))
    if cfg.kv_cache_memory is None:
        num_blocks = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
    else:
        budget = cfg.kv_cache_memory - rings * cfg.max_num_seqs
        if per_block == 0:
            num_blocks = 1
        elif budget < per_block:
            raise ValueError(
                f"kv_cache_memory {cfg.kv_cache_memory} bytes is too small: the sliding-window rings of "
                f"{cfg.max_num_seqs} sequences take {rings * cfg.max_num_seqs} and one block {per_block}"
            )
        else:
            num_blocks = budget // per_block
    return CacheConfig(cfg.max_num_seqs, max(1, num_blocks), cfg.block_size, max_model_len)


def geometry(model: BlockDiffusionModel, cfg: CacheConfig) -> CacheGeometry:
    return CacheGeometry(
        block_size=cfg.block_size, ring=ring_size(model, cfg.max_model_len), window=model.config.sliding_window,
        encoder_causal=model.config.encoder_causal,
    )


def allocate(model: BlockDiffusionModel, cfg: CacheConfig, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) flat storage: [entries, local KV heads, head dim]."""
    ring = geometry(model, cfg).ring
    out = []
    for spec in model.kv_cache_spec():
        entries = cfg.num_slots * ring if spec.sliding else cfg.num_blocks * cfg.block_size
        shape = (entries, spec.kv_heads, spec.head_dim)
        out.append((torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device)))
    return out
