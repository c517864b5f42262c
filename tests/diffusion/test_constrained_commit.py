"""The constrained-commit programme (blockdiff/diffusion/constrained.py) against an exhaustive
search over every token sequence of a small vocabulary: the same best score, a sequence the
automaton accepts, EOS only where the text is complete, acceptance within what max_tokens leaves;
and the same tokens from the shards of two and three gloo ranks, which exchange only
[canvases x positions x atoms]-sized statistics, never the logits."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from blockdiff.step import CanvasConstraint
from structured_checks import automaton, commit, ranked_commit

# A small vocabulary: tokens spell these bytes; EOS (4) and a special token (6) spell nothing.
TOKENS = [b"a", b"b", b"ab", b"c", None, b"ba", None, b"bc"]
EOS = 4
REGEX = "(ab|ba)+c?"


def accepted(text: str) -> bool:
    return re.fullmatch(REGEX, text) is not None


def extensible(text: str, budget: int) -> bool:
    """Some continuation of at most `budget` tokens completes `text`."""
    if accepted(text):
        return True
    if budget == 0:
        return False
    return any(extensible(text + t.decode(), budget - 1) for t in TOKENS if t)


def score(seq, L: torch.Tensor, remaining: int) -> float | None:
    """The programme's objective of one canvas, or None where the sequence is not allowed: tokens
    score their logit up to the stop; after an end token every position scores its maximum."""
    p = len(seq)
    stop = min(p, remaining)
    text, total = "", 0.0
    for k in range(stop):
        t = seq[k]
        if t == EOS:
            if not accepted(text):
                return None
            return total + float(L[k, t]) + float(L[k + 1 : stop].amax(-1).sum())
        if TOKENS[t] is None:
            return None
        text += TOKENS[t].decode()
        total += float(L[k, t])
    if remaining <= p:
        return total if accepted(text) else None
    return total if extensible(text, remaining - p) else None


def best_score(L: torch.Tensor, remaining: int) -> float:
    scores = (score(seq, L, remaining) for seq in itertools.product(range(len(TOKENS)), repeat=L.shape[0]))
    return max(s for s in scores if s is not None)


@pytest.mark.parametrize("remaining", [2, 3, 4, 5, 7])
def test_programme_finds_the_best_accepted_canvas(remaining):
    a = automaton(REGEX, TOKENS)
    g = torch.Generator().manual_seed(remaining)
    for trial in range(4):
        logits = torch.randn(2, 4, len(TOKENS), generator=g) * 3
        constraints = [CanvasConstraint(row, "test", a.initial, remaining, (EOS,)) for row in range(2)]
        tokens, logprob, _ = commit(logits, a, constraints)
        for row in range(2):
            L = torch.log_softmax(logits[row], -1)
            got = score(tokens[row].tolist(), L, remaining)
            assert got is not None, (tokens[row], remaining)
            assert got == pytest.approx(best_score(L, remaining), abs=1e-5)
            assert torch.allclose(logprob[row], L.gather(-1, tokens[row].unsqueeze(-1)).squeeze(-1), atol=1e-6)


def test_programme_starts_where_the_previous_canvas_ended():
    """From the state after "ab", the canvas may close the text at once: "c" then EOS is allowed."""
    a = automaton(REGEX, TOKENS)
    after = a.walk(a.initial, [2])  # "ab"
    logits = torch.full((1, 3, len(TOKENS)), -5.0)
    logits[0, 0, 3] = logits[0, 1, EOS] = 5.0  # "c", EOS, then anything
    logits[0, 2, 0] = 5.0
    tokens, _, _ = commit(logits, a, [CanvasConstraint(0, "test", after, 10, (EOS,))])
    assert tokens[0, :2].tolist() == [3, EOS]
    # From the start, "c" is not allowed first: the best canvas starts otherwise.
    tokens, _, _ = commit(logits, a, [CanvasConstraint(0, "test", a.initial, 10, (EOS,))])
    assert tokens[0, 0].item() != 3 and score(tokens[0].tolist(), torch.log_softmax(logits[0], -1), 10) is not None


def test_a_canvas_the_automaton_accepts_commits_unchanged():
    a = automaton(REGEX, TOKENS)
    logits = torch.full((1, 5, len(TOKENS)), -3.0)
    for k, t in enumerate([2, 5, 3, EOS, 1]):  # "ab" "ba" "c" EOS, then a dropped "b"
        logits[0, k, t] = 4.0
    tokens, _, _ = commit(logits, a, [CanvasConstraint(0, "test", a.initial, 64, (EOS,))])
    assert tokens[0].tolist() == [2, 5, 3, EOS, 1]


def test_ties_go_to_the_lowest_token_id():
    a = automaton("x+", [b"x", b"y", b"x", None])
    logits = torch.zeros(1, 2, 4)
    logits[0, :, 3] = -10.0
    tokens, _, _ = commit(logits, a, [CanvasConstraint(0, "test", a.initial, 2, (3,))])
    assert tokens[0].tolist() == [0, 0]


def test_ranks_commit_what_one_rank_commits(tp_ranks):
    a = automaton(REGEX, TOKENS * 5)  # 40 tokens, split over the ranks
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 6, 40, generator=g) * 2
    constraints = [CanvasConstraint(0, "test", a.initial, 4, (EOS,)), CanvasConstraint(2, "test", a.initial, 20, (EOS, 14))]
    want, want_lp, _ = commit(logits, a, constraints)
    for tokens, lp, moved in tp_ranks.run(ranked_commit, logits, a, constraints, gather=True):
        assert torch.equal(tokens, want)
        assert torch.allclose(lp, want_lp, atol=1e-6)
        # The atom maxima, the winning tokens and their logprobs: never the [canvases, P, vocab] logits.
        atoms = a.num_atoms + 2
        assert moved == 4 * 2 * 6 * atoms + 8 * 2 * 6 + 4 * 2 * 6
