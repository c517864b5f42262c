"""Soft embeddings for self-conditioning: softmax(previous logits) @ embedding * scale.

On one device this is one matmul and the scale. Under tensor parallelism each rank holds only its
rows W_r of the embedding, and since P @ W == sum_r P_r @ W_r, each rank multiplies the
probabilities of its own vocabulary slice by its own rows and one all-reduce of the small
[tokens, hidden] result completes the sum. The [vocab, hidden] table is never gathered.
"""

from __future__ import annotations

import torch

from blockdiff.matmul import linear
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard


def soft_embedding(
    probs: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
    shard: VocabShard | None = None,
    group: TPGroup | None = None,
) -> torch.Tensor:
    """Soft embeddings [..., hidden] of probabilities [..., vocab] (in `weight`'s dtype).

    - `shard` None: `weight` holds the whole vocabulary.
    - `shard` given: `weight` holds this rank's `shard.local_rows`; `probs` is either over the full
      vocabulary (this rank's original and added ranges are taken from it) or already this rank's
      local rows (padding entries must be zero). The partial sums are all-reduced over `group`.
    """
    if shard is None:
        if probs.shape[-1] != weight.shape[0]:
            raise ValueError(
                f"probabilities cover a vocabulary of {probs.shape[-1]} tokens but the embedding has "
                f"{weight.shape[0]} rows; pass the VocabShard of a sharded embedding"
            )
        return linear(probs, weight.t()) * scale

    if weight.shape[0] != shard.local_rows:
        raise ValueError(f"embedding shard has {weight.shape[0]} rows, the VocabShard says {shard.local_rows}")
    vocab = probs.shape[-1]
    if vocab == shard.local_rows and vocab != shard.vocab_size:
        out = linear(probs, weight.t())
    elif vocab == shard.vocab_size:
        out = linear(probs[..., shard.org_start : shard.org_end], weight[: shard.num_org].t())
        if shard.num_added:
            added_rows = weight[shard.org_rows : shard.org_rows + shard.num_added]
            out += linear(probs[..., shard.added_start : shard.added_end], added_rows.t())
    else:
        raise ValueError(
            f"probabilities cover {vocab} tokens, which is neither the full vocabulary "
            f"({shard.vocab_size}) nor this rank's {shard.local_rows} rows"
        )
    if group is not None and group.size > 1:
        group.all_reduce(out)
    return out * scale
