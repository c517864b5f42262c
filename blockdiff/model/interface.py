"""What the engine needs of a model, and nothing more.

The worker (model runner, KV cache) talks to a model only through `BlockDiffusionModel`, and the
loader reads its checkpoints through its architecture's `CheckpointFormat`. A second block-diffusion
architecture implements both in new files and adds an entry to `registry.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from blockdiff.config import ModelConfig
from blockdiff.model.attention import AttentionMetadata
from blockdiff.step import ImageInputs
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard


@dataclass(frozen=True)
class LayerCacheSpec:
    """The K/V one layer keeps per position, on this rank."""

    sliding: bool
    kv_heads: int
    head_dim: int


class StepAdapters(Protocol):
    """A model's per-request adapters, where its layers were replaced by adapter-capable ones: which
    adapter slot each request slot runs with (`table` [slots + 1], -1: none), how a step's rows use
    them (`level`: 0 none, 1 some, 2 on the experts too), and the mapping that the runner sets
    before each forward (`set`: each token's adapter slot, or None for none)."""

    table: torch.Tensor

    def level(self, rows) -> int: ...

    def set(self, index: torch.Tensor | None, meta: AttentionMetadata, experts: bool = False) -> None: ...


class BlockDiffusionModel(Protocol):
    config: ModelConfig
    dtype: torch.dtype
    shard: VocabShard  # this rank's rows of the vocabulary (the LM head's logits are split by them)
    group: TPGroup

    def kv_cache_spec(self) -> list[LayerCacheSpec]:
        """One entry per layer, in the order `forward` takes the cache."""
        ...

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: list[tuple[torch.Tensor, torch.Tensor]],
                soft_embeds: torch.Tensor | None = None, images: ImageInputs | None = None,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Packed [encoder | decoder | padding] ids -> float32 logits of the decoder tokens over this
        rank's vocabulary rows (in `logits_out` where given); encoder rows append their K/V to
        `cache`. `images`: soft tokens that replace image placeholders among the encoder tokens."""
        ...

    def static_shapes(self, device: torch.device) -> bool:
        """Whether a step of canvases can run with static shapes and no host sync on `device`
        (compiled, or captured as a CUDA graph)."""
        ...


class CheckpointFormat:
    """How an architecture's checkpoints are read: its config.json parsed, and its tensor names
    mapped to its model's parameters (model/loader.py loads by them)."""

    def parse_config(self, raw: dict[str, Any]) -> ModelConfig:
        """config.json -> the engine's ModelConfig, with the architecture's own config as `arch`;
        ConfigError for what the architecture cannot run."""
        raise NotImplementedError

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        """A checkpoint tensor -> (parameter name, part of a fused parameter or None), or None when
        it is not a weight of this architecture."""
        raise NotImplementedError

    def secondary(self, name: str, target: str) -> bool:
        """Whether `name` is a second spelling of `target`, loaded only where the first is absent."""
        return False

    def ignored(self, model: nn.Module, name: str) -> bool:
        """Whether the tensor is not loaded into `model` (a tied head, a part the model lacks)."""
        return False

    def prepare(self, model: nn.Module, files: list[str]) -> None:
        """Before loading: adapt `model` to what the checkpoint's files hold."""


def layer_kinds(model: BlockDiffusionModel) -> set[bool]:
    """The layer kinds present (True: sliding), as `build_metadata` takes them."""
    return {spec.sliding for spec in model.kv_cache_spec()}
