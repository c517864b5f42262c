"""Benchmark prompts, made as `vllm bench serve` makes them for its datasets of the same names:
`random` (random tokens, lengths spread by `--random-range-ratio`), `prefix-repetition` (a few
random prefixes shared by many prompts) and `sharegpt` (the first two turns of the conversations
in a ShareGPT JSON file)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Words for text prompts: tokenized by the served tokenizer, or sent as words when none is at hand.
WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word"
).split()
_FIT_ROUNDS = 8
# vLLM's filter for ShareGPT conversations (benchmarks/datasets/utils.py, is_valid_sequence).
_SHAREGPT_MIN_LEN, _SHAREGPT_MAX_PROMPT, _SHAREGPT_MAX_TOTAL = 4, 1024, 2048


@dataclass
class Sample:
    prompt: str | list[int]  # text, or token ids for a completions endpoint
    prompt_len: int  # its tokens as the server counts them (a chat adds its template's)
    output_len: int  # max_tokens


def spread_lengths(num: int, length: int, ratio: float, rng: np.random.Generator, minimum: int = 0) -> list[int]:
    """vLLM's `--random-range-ratio` r: `num` lengths drawn uniformly from the integers in
    [floor(length (1 - r)), ceil(length (1 + r))], none below `minimum`; r = 0 gives `length` each."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    low = max(minimum, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    return rng.integers(low, high + 1, size=num).tolist()


def random_token_prompts(lengths: Sequence[int], vocab_size: int, special_ids: set[int], seed: int) -> list[list[int]]:
    """One prompt per length, of exactly that many token ids drawn uniformly from the vocabulary,
    special tokens (padding, BOS, EOS) left out so no prompt ends early; other special tokens (turn
    markers) may appear, as in vLLM's random dataset."""
    allowed = torch.tensor([t for t in range(vocab_size) if t not in special_ids])
    if len(allowed) == 0:
        raise ValueError(f"a vocabulary of {vocab_size} tokens has no non-special token to draw prompts from")
    g = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist() for n in lengths]


def word_prompts(lengths: Sequence[int], seed: int) -> list[list[str]]:
    """One list of random words per length: prompts for a server whose tokenizer is unknown."""
    rng = random.Random(seed)
    return [[rng.choice(WORDS) for _ in range(n)] for n in lengths]


def tokenized_word_prompts(tok, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """One prompt per length, of exactly that many token ids of `tok` (a PromptTokenizer): random
    words, tokenized, cut to length."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids: list[int] = []
        while len(ids) < n:
            ids += tok.encode(" ".join(rng.choice(WORDS) for _ in range(n - len(ids))) + " ")
        out.append(ids[:n])
    return out


def prefix_repetition_prompts(draw: Callable[[list[int], int], list[Sequence]], num: int, prefix_len: int,
                              suffix_len: int, num_prefixes: int, seed: int) -> list[list]:
    """`num` prompts, prompt i made of prefix i mod `num_prefixes` and a suffix of its own, so a
    server that caches prefixes computes each prefix once. `draw(lengths, seed)` gives one random
    sequence (token ids or words) per length; prefixes and suffixes come from different seeds."""
    if num_prefixes > num:
        raise ValueError(f"--prefix-repetition-num-prefixes ({num_prefixes}) must not exceed --num-prompts ({num})")
    prefixes = draw([prefix_len] * num_prefixes, seed)
    suffixes = draw([suffix_len] * num, seed + 1)
    return [list(prefixes[i % num_prefixes]) + list(suffixes[i]) for i in range(num)]


def fit_text(tok, ids: list[int], more: Callable[[int], list[int]]) -> tuple[str, int]:
    """Text that `tok` encodes to exactly len(ids) tokens: `ids` decoded, then cut, or padded with
    `more(n)` ids, until it encodes to that length again (decoding and encoding can merge or split
    tokens where pieces meet; vLLM's random dataset corrects its prompts the same way).
    -> (the text, its token count), the count off the target only if the rounds run out."""
    target = len(ids)
    text = tok.decode(ids)
    for _ in range(_FIT_ROUNDS):
        got = tok.encode(text)
        if len(got) == target:
            return text, target
        text = tok.decode(got[:target] if len(got) > target else got + more(target - len(got)))
    return text, len(tok.encode(text))


def sharegpt_samples(path: str, num: int, seed: int, tok, special_tokens: int, output_len: int | None) -> list[Sample]:
    """vLLM's ShareGPT dataset: conversations with two turns or more, shuffled with `seed`; the
    first turn is the prompt, the second's token count the output length (or `output_len`).
    Conversations outside vLLM's limits (fewer than 4 tokens, a prompt over 1024, both over 2048)
    are skipped; too few left are repeated, as vLLM does, to make `num`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path} is not a ShareGPT file: a JSON list of {{\"conversations\": [...]}}")
    entries = [e for e in data if isinstance(e, dict) and isinstance(e.get("conversations"), list)
               and len(e["conversations"]) >= 2]
    rng = random.Random(seed)
    rng.shuffle(entries)
    samples = []
    for entry in entries:
        if len(samples) == num:
            break
        turns = entry["conversations"]
        prompt, completion = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if not isinstance(prompt, str) or not isinstance(completion, str):
            continue
        prompt_len = special_tokens + len(tok.encode(prompt))
        n = output_len if output_len is not None else len(tok.encode(completion))
        if (prompt_len < _SHAREGPT_MIN_LEN or (output_len is None and n < _SHAREGPT_MIN_LEN)
                or prompt_len > _SHAREGPT_MAX_PROMPT or prompt_len + n > _SHAREGPT_MAX_TOTAL):
            continue
        samples.append(Sample(prompt, prompt_len, n))
    if not samples:
        raise ValueError(f"--dataset-path {path} has no conversation of two turns within vLLM's ShareGPT limits "
                         f"(prompt {_SHAREGPT_MIN_LEN}-{_SHAREGPT_MAX_PROMPT} tokens, prompt + output at most "
                         f"{_SHAREGPT_MAX_TOTAL})")
    if len(samples) < num:
        print(f"{path}: {len(samples)} usable conversations; repeating some to make {num} prompts")
        samples += [rng.choice(samples) for _ in range(num - len(samples))]
    return samples


def special_token_ids(config) -> set[int]:
    """Padding, BOS and EOS ids of a `ModelConfig`."""
    ids = set(config.eos_token_ids)
    ids.update(t for t in (config.pad_token_id, config.bos_token_id) if t is not None)
    return ids
