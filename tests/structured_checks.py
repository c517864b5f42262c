"""What the structured-output tests run on every rank of a real process group, and the pieces they
share: a token automaton over a small made-up vocabulary, and the programme run from a rank's
shard of full-vocabulary logits."""

from __future__ import annotations

import torch

from blockdiff.diffusion.constrained import DeviceAutomaton, constrained_tokens
from blockdiff.step import Automaton, CanvasConstraint
from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext
from blockdiff.parallel.vocab import VocabShard
from blockdiff.structured.compiler import MAX_STATES
from blockdiff.structured.index import build_index
from rank_checks import local_columns


def automaton(regex: str, tokens: list[bytes | None], key: str = "test") -> Automaton:
    return Automaton(key=key, **build_index(regex, tokens, len(tokens), MAX_STATES))


def commit(logits: torch.Tensor, a: Automaton, constraints: list[CanvasConstraint], group: TPGroup = TPGroup(),
           rank: int = 0, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The constrained commits of canvases `constraints` of full-vocabulary `logits` [canvases, P, V]
    from this rank's shard; -> (tokens, logprobs, bytes the ranks exchanged)."""
    shard = VocabShard.make(rank, group.size, logits.shape[-1])
    vocab = VocabParallel(shard, group)
    d = vocab.distribution(local_columns(shard, logits / temperature))
    fallback = vocab.argmax(d)
    group.counter.reset()
    rows = [c.row for c in constraints]
    tokens, logprob = constrained_tokens(d, fallback[rows], constraints, DeviceAutomaton(a, vocab, logits.device), vocab)
    return tokens, logprob, group.counter.bytes


def ranked_commit(ctx: RankContext, logits, a, constraints) -> tuple[torch.Tensor, torch.Tensor, int]:
    return commit(logits, a, constraints, ctx.group, ctx.rank)
