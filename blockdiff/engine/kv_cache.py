"""KV cache storage and block accounting.

Full-attention layers keep every committed position, in fixed-size blocks handed out per request.
Sliding layers only ever need the last `window - 1` positions, so each request slot owns a ring of
that many entries per sliding layer, whatever the length of the request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdiff.model.attention import CacheGeometry
from blockdiff.model.diffusion_gemma import DiffusionGemma


@dataclass(frozen=True)
class CacheConfig:
    num_slots: int  # requests that can hold cache at once (max_num_seqs)
    num_blocks: int
    block_size: int
    max_model_len: int


def cache_bytes_per_block(model: DiffusionGemma, block_size: int) -> int:
    size = torch.tensor([], dtype=model.dtype).element_size()
    return sum(
        2 * block_size * layer.attn.local_kv_heads * layer.attn.head_dim * size
        for layer, spec in zip(model.layers, model.config.layers)
        if not spec.sliding
    )


def ring_bytes_per_slot(model: DiffusionGemma, ring: int) -> int:
    size = torch.tensor([], dtype=model.dtype).element_size()
    return sum(
        2 * ring * layer.attn.local_kv_heads * layer.attn.head_dim * size
        for layer, spec in zip(model.layers, model.config.layers)
        if spec.sliding
    )


def ring_size(model: DiffusionGemma, max_model_len: int) -> int:
    """Positions a sliding layer keeps per slot: the window's past, or the whole sequence if shorter."""
    window = model.config.sliding_window
    return max(1, min(window - 1, max_model_len)) if window else 1


def geometry(model: DiffusionGemma, cfg: CacheConfig) -> CacheGeometry:
    return CacheGeometry(
        block_size=cfg.block_size, ring=ring_size(model, cfg.max_model_len), window=model.config.sliding_window,
        encoder_causal=model.config.encoder_causal,
    )


def allocate(model: DiffusionGemma, cfg: CacheConfig, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) flat storage: [entries, local KV heads, head dim]."""
    ring = geometry(model, cfg).ring
    out = []
    for layer, spec in zip(model.layers, model.config.layers):
        entries = cfg.num_slots * ring if spec.sliding else cfg.num_blocks * cfg.block_size
        shape = (entries, layer.attn.local_kv_heads, layer.attn.head_dim)
        out.append((torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device)))
    return out


class BlockAllocator:
    """Free-list of full-attention cache blocks. A request reserves everything it can ever commit
    when it is admitted, so a running request never waits for memory and never gets evicted."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self.free)

    def allocate(self, tokens: int) -> tuple[int, ...]:
        n = self.blocks_for(tokens)
        if n > len(self.free):
            raise RuntimeError(f"KV cache exhausted: {n} blocks asked, {len(self.free)} free")
        return tuple(self.free.pop() for _ in range(n))

    def release(self, blocks: tuple[int, ...]) -> None:
        self.free.extend(reversed(blocks))

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)
