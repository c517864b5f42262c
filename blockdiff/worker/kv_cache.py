"""KV cache storage, its size, and where a position lives in it.

Both layer kinds are paged in blocks of `block_size` positions, with one block table per kind for
each request (docs/architecture.md, "The KV cache"). Full-attention layers keep every committed
position. Sliding layers only ever read the last `window - 1` positions, so the engine gives back a
request's sliding blocks once they fall out of that reach: their pool is sized for what the running
requests can reach, not for their lengths.
"""

from __future__ import annotations

import torch

from blockdiff.config import EngineConfig
from blockdiff.model.attention import FP8_KV_DTYPE, CacheGeometry
from blockdiff.model.interface import BlockDiffusionModel
from blockdiff.step import CacheConfig


def cache_dtype(model: BlockDiffusionModel, kv_cache_dtype: str) -> torch.dtype:
    """The dtype of the cache's entries: the model's ("auto") or FP8 E4M3 ("fp8", "fp8_e4m3"), one byte."""
    return model.dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPE


def _bytes(model: BlockDiffusionModel, sliding: bool, positions: int, kv_cache_dtype: str) -> int:
    size = torch.tensor([], dtype=cache_dtype(model, kv_cache_dtype)).element_size()
    return sum(2 * positions * s.kv_heads * s.head_dim * size for s in model.kv_cache_spec() if s.sliding == sliding)


def cache_bytes_per_block(model: BlockDiffusionModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
    return _bytes(model, False, block_size, kv_cache_dtype)


def sliding_bytes_per_block(model: BlockDiffusionModel, block_size: int, kv_cache_dtype: str = "auto") -> int:
    return _bytes(model, True, block_size, kv_cache_dtype)


def sliding_blocks_needed(past: int, canvas_length: int, block_size: int, num_slots: int, max_prefill_tokens: int) -> int:
    """Sliding blocks the running requests can hold at once. A request holds the blocks of its last
    `past` positions plus those of the tokens its step writes: a prompt chunk (all chunks of a step
    share `max_prefill_tokens`) or a canvas. Twice that, so that sliding blocks of cached prefixes
    outlive their requests for a while."""
    per = lambda n: -(-n // block_size)  # noqa: E731
    live = num_slots * (per(past) + per(canvas_length) + 3) + per(max_prefill_tokens)
    return 2 * live


def size_cache(model: BlockDiffusionModel, cfg: EngineConfig, max_model_len: int) -> CacheConfig:
    """The cache `cfg` asks for, sized on a built (rank's) model, so per-rank head counts are right."""
    per_block = cache_bytes_per_block(model, cfg.block_size, cfg.kv_cache_dtype)
    num_sliding = sliding_blocks_needed(model.config.window_past(max_model_len), model.config.canvas_length, cfg.block_size,
                                        cfg.max_num_seqs, cfg.max_prefill_tokens)
    sliding = sliding_bytes_per_block(model, cfg.block_size, cfg.kv_cache_dtype) * num_sliding
    if cfg.kv_cache_memory is None:
        num_blocks = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
    else:
        budget = cfg.kv_cache_memory - sliding
        if per_block == 0:
            num_blocks = 1
        elif budget < per_block:
            raise ValueError(
                f"kv_cache_memory {cfg.kv_cache_memory} bytes is too small: the sliding-window blocks of "
                f"{cfg.max_num_seqs} sequences take {sliding} and one block {per_block}"
            )
        else:
            num_blocks = budget // per_block
    return CacheConfig(cfg.max_num_seqs, max(1, num_blocks), cfg.block_size, max_model_len, num_sliding,
                       cfg.kv_cache_dtype, cfg.calculate_kv_scales)


def geometry(model: BlockDiffusionModel, cfg: CacheConfig) -> CacheGeometry:
    return CacheGeometry(
        block_size=cfg.block_size, window_past=model.config.window_past(cfg.max_model_len),
        window=model.config.sliding_window, encoder_causal=model.config.encoder_causal,
    )


def allocate(model: BlockDiffusionModel, cfg: CacheConfig, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) flat storage: [local KV heads, entries, head dim]. Head-major, so that one
    copy of a row's cache blocks is already the [keys, head dim] operand of each KV head's product.
    An FP8 cache holds K / scale and V / scale (model/attention.py keeps each layer's scales)."""
    dtype = cache_dtype(model, cfg.kv_cache_dtype)
    out = []
    for spec in model.kv_cache_spec():
        entries = (cfg.sliding_blocks if spec.sliding else cfg.num_blocks) * cfg.block_size
        shape = (spec.kv_heads, entries, spec.head_dim)
        out.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
    return out
