"""Soft embeddings for self-conditioning: softmax(previous logits) @ embedding * scale.

On one device this is one matmul and the scale. Under tensor parallelism each rank holds only its
rows W_r of the embedding, and since P @ W == sum_r P_r @ W_r, each rank multiplies the
probabilities of its own vocabulary slice by its own rows and one all-reduce of the small
[tokens, hidden] result completes the sum. The [vocab, hidden] table is never gathered.
"""

from __future__ import annotations

import torch

from blockdiff.ops.matmul import linear
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard


def soft_embedding(
    probs: torch.Tensor,
    weight: torch.Tensor,
    scale: float | torch.Tensor,
    shard: VocabShard | None = None,
    group: TPGroup | None = None,
) -> torch.Tensor:
    """Soft embeddings [..., hidden] of probabilities [..., vocab], times `scale` (a number, or a
    tensor broadcasting against the result, e.g. embed_scale / Σexp per canvas for unnormalised
    probabilities).

    - `probs` over exactly `weight`'s rows (the whole vocabulary on one rank, or this rank's local
      rows with zero padding entries): one matmul.
    - `shard` given and `probs` over the full vocabulary while `weight` holds this rank's
      `shard.local_rows`: this rank's original and added ranges are taken from `probs`.
    Partial sums are all-reduced over `group` when it has more than one rank.
    """
    vocab = probs.shape[-1]
    if vocab == weight.shape[0]:
        out = linear(probs, weight.t())
    elif shard is not None and vocab == shard.vocab_size and weight.shape[0] == shard.local_rows:
        out = linear(probs[..., shard.org_start : shard.org_end], weight[: shard.num_org].t())
        if shard.num_added:
            added_rows = weight[shard.org_rows : shard.org_rows + shard.num_added]
            out += linear(probs[..., shard.added_start : shard.added_end], added_rows.t())
    elif shard is None:
        raise ValueError(
            f"probabilities cover {vocab} tokens but the embedding has {weight.shape[0]} rows; "
            "pass the VocabShard of a sharded embedding"
        )
    else:
        raise ValueError(
            f"probabilities cover {vocab} tokens, which is neither the full vocabulary "
            f"({shard.vocab_size}) nor this rank's {weight.shape[0]} rows"
        )
    if group is not None and group.size > 1:
        group.all_reduce(out)
    return out * scale
