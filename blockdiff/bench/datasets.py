"""Benchmark prompts: random token ids, as `vllm bench serve --dataset-name random` makes them, and
prompts sharing prefixes, as its `--dataset-name prefix-repetition` makes them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def prefix_repetition_prompts(draw: Callable[[int, int, int], list[Sequence]], num: int, prefix_len: int,
                              suffix_len: int, num_prefixes: int, seed: int) -> list[list]:
    """`num` prompts, prompt i made of prefix i mod `num_prefixes` and a suffix of its own, so a
    server that caches prefixes computes each prefix once. `draw(n, length, seed)` gives n random
    sequences (token ids or words); prefixes and suffixes come from different seeds."""
    if num_prefixes > num:
        raise ValueError(f"--prefix-repetition-num-prefixes ({num_prefixes}) must not exceed --num-prompts ({num})")
    prefixes = draw(num_prefixes, prefix_len, seed)
    suffixes = draw(num, suffix_len, seed + 1)
    return [list(prefixes[i % num_prefixes]) + list(suffixes[i]) for i in range(num)]


def special_token_ids(config) -> set[int]:
    """Padding, BOS and EOS ids of a `ModelConfig`."""
    ids = set(config.eos_token_ids)
    ids.update(t for t in (config.pad_token_id, config.bos_token_id) if t is not None)
    return ids
