"""Benchmark prompts: random token ids, as `vllm bench serve --dataset-name random` makes them."""

from __future__ import annotations

import torch


def random_token_prompts(num: int, length: int, vocab_size: int, special_ids: set[int], seed: int) -> list[list[int]]:
    """`num` prompts of exactly `length` token ids drawn uniformly from the vocabulary, special
    tokens (padding, BOS, EOS) left out so no prompt ends early; other special tokens (turn markers)
    may appear, as in vLLM's random dataset."""
    allowed = torch.tensor([t for t in range(vocab_size) if t not in special_ids])
    if len(allowed) == 0:
        raise ValueError(f"a vocabulary of {vocab_size} tokens has no non-special token to draw prompts from")
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(allowed), (num, length), generator=g)
    return allowed[picks].tolist()


def special_token_ids(config) -> set[int]:
    """Padding, BOS and EOS ids of a `ModelConfig`."""
    ids = set(config.eos_token_ids)
    ids.update(t for t in (config.pad_token_id, config.bos_token_id) if t is not None)
    return ids
