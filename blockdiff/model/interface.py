"""What the engine needs of a model, and nothing more.

The worker (model runner, KV cache) talks to a model only through `BlockDiffusionModel`; a second
block-diffusion architecture implements it in a new file and adds a line to `registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from blockdiff.config import ModelConfig
from blockdiff.model.attention import AttentionMetadata
from blockdiff.model.vision import ImageInputs
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard


@dataclass(frozen=True)
class LayerCacheSpec:
    """The K/V one layer keeps per position, on this rank."""

    sliding: bool
    kv_heads: int
    head_dim: int


class BlockDiffusionModel(Protocol):
    config: ModelConfig
    dtype: torch.dtype
    shard: VocabShard  # this rank's rows of the vocabulary (the LM head's logits are split by them)
    group: TPGroup

    def kv_cache_spec(self) -> list[LayerCacheSpec]:
        """One entry per layer, in the order `forward` takes the cache."""
        ...

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: list[tuple[torch.Tensor, torch.Tensor]],
                soft_embeds: torch.Tensor | None = None, images: ImageInputs | None = None) -> torch.Tensor:
        """Packed [encoder | decoder | padding] ids -> float32 logits of the decoder tokens over this
        rank's vocabulary rows; encoder rows append their K/V to `cache`. `images`: soft tokens
        that replace image placeholders among the encoder tokens."""
        ...

    def static_shapes(self, device: torch.device) -> bool:
        """Whether a step of canvases can run with static shapes and no host sync on `device`
        (compiled, or captured as a CUDA graph)."""
        ...

    def soft_embed(self, probs: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """The next step's self-conditioning input [rows * CL, hidden] from this rank's unnormalised
        probabilities [rows, CL, local vocab] and their full-vocabulary sums [rows, CL]."""
        ...


def layer_kinds(model: BlockDiffusionModel) -> set[bool]:
    """The layer kinds present (True: sliding), as `build_metadata` takes them."""
    return {spec.sliding for spec in model.kv_cache_spec()}
