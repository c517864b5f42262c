"""Inverse-CDF sampling over a (sharded) vocabulary against the plain reference
searchsorted(cumsum(w), u · Σw, right=True), on one rank and on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from rank_checks import vocab_statistics

from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext

SINGLE = RankContext(0, 1, torch.device("cpu"), TPGroup())
# Not multiples of the sampler's 128-token chunks, nor of 2 or 3 ranks' shards.
VOCABS = [263, 385, 1001]
U_MAX = 1.0 - 2**-24  # the largest float32 below 1


def _uniforms(rows: int, seed: int) -> torch.Tensor:
    u = torch.rand(rows, generator=torch.Generator().manual_seed(seed))
    u[:3] = torch.tensor([0.0, 0.5, U_MAX])
    return u


def _zero_one_logits(rows: int, vocab: int, tail: int, seed: int) -> torch.Tensor:
    """Logits of 0 or -1e4: the weights exp(x - max) are exactly 1 or 0, so every order of summing
    them gives the same integers and the reference is exact."""
    g = torch.Generator().manual_seed(seed)
    x = torch.where(torch.rand(rows, vocab, generator=g) < 0.5, 0.0, -1e4)
    x[:, vocab - tail :] = -1e4  # a tail of zero probability
    x[torch.arange(rows), torch.randint(0, vocab - tail, (rows,), generator=g)] = 0.0  # a max in every row
    return x


def _reference(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    w = torch.softmax(logits, dim=-1)
    w = (w > 0).float()  # the exact 0/1 weights of _zero_one_logits
    cum = w.cumsum(-1)
    ids = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    # u · Σw can round onto Σw (u just below 1): the limit u -> 1 is the last token with mass.
    last = torch.where(w > 0, torch.arange(w.shape[-1]), -1).amax(-1)
    return torch.minimum(ids, last)


def _random_logits_with_dead_tail(rows: int, vocab: int, tail: int) -> torch.Tensor:
    x = 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    x[:, vocab - tail :] = -1e4
    return x


@pytest.mark.parametrize("vocab", VOCABS)
def test_one_rank_samples_the_reference(vocab):
    logits = _zero_one_logits(64, vocab, vocab // 5, seed=vocab)
    u = _uniforms(64, seed=vocab)
    got = vocab_statistics(SINGLE, logits, u, 1)["sample"]
    assert torch.equal(got, _reference(logits, u))


@pytest.mark.parametrize("vocab", VOCABS)
def test_one_rank_never_samples_a_zero_probability_token(vocab):
    """u -> 1 with the last tokens at probability 0: the sums the search runs over and the total
    the target is cut from must agree, or the search runs past the last token with mass."""
    tail = vocab // 4
    logits = _random_logits_with_dead_tail(256, vocab, tail)
    got = vocab_statistics(SINGLE, logits, torch.full((256,), U_MAX), 1)["sample"]
    assert (got < vocab - tail).all()


@pytest.mark.parametrize("vocab", VOCABS)
def test_ranks_sample_the_reference(tp_ranks, vocab):
    logits = _zero_one_logits(64, vocab, vocab // 5, seed=vocab)
    u = _uniforms(64, seed=vocab)
    want = _reference(logits, u)
    for got in tp_ranks.run(vocab_statistics, logits, u, 1, gather=True):
        assert torch.equal(got["sample"], want)


def test_ranks_never_sample_a_zero_probability_token(tp_ranks):
    vocab, tail = 1001, 300  # the whole last rank's shard and part of the one before it
    logits = _random_logits_with_dead_tail(256, vocab, tail)
    for got in tp_ranks.run(vocab_statistics, logits, torch.full((256,), U_MAX), 1, gather=True):
        assert (got["sample"] < vocab - tail).all()


@pytest.mark.parametrize("vocab", [5, *VOCABS])
def test_argmax_is_torch_argmax_with_ties_to_the_lowest_id(vocab):
    """From the per-chunk maxima: ties inside a chunk, across chunks, and in the short last chunk."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 3, (64, vocab), generator=g).float()  # many ties
    logits[0, -1] = 10.0  # the maximum alone in the short last chunk
    logits[1, [vocab // 2, vocab - 1]] = 10.0
    got = vocab_statistics(SINGLE, logits, torch.zeros(64), 1)["argmax"]
    assert torch.equal(got, logits.argmax(dim=-1))
