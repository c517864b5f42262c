"""The memory-bounded sampler: tiling its temporaries over positions changes nothing it computes
(entropy, argmax, candidates, self-conditioning probabilities and embeddings, top logprobs), on one
rank and on real gloo ranks, and moves the same bytes."""

from __future__ import annotations

import pytest
import torch
from rank_checks import tiled_sampler

from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext

SINGLE = RankContext(0, 1, torch.device("cpu"), TPGroup())
CANVASES, CL, VOCAB, HIDDEN = 3, 5, 263, 16  # 15 positions; the vocabulary is no multiple of 128
ROW = VOCAB * 4  # bytes of one position's float32 temporary on one rank (an upper bound on shards)
# Workspaces of one position, a few, more than one canvas, and all of them.
WORKSPACES = [ROW, 4 * ROW, 7 * ROW, 100 * ROW]
KEYS = ("entropy", "argmax", "sample", "total", "probs", "top_logprobs", "top_ids")


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(CANVASES, CL, VOCAB, generator=g)
    logits[1, 2, [3, VOCAB - 1]] = logits.max() + 1  # a tie across the ends of the vocabulary
    u = torch.rand(CANVASES, CL, generator=g)
    u[0, 0], u[0, 1] = 0.0, 1.0 - 2**-24
    return logits, u, torch.randn(VOCAB, HIDDEN, generator=g)


def _assert_same(got: dict, want: dict) -> None:
    for key in KEYS:
        assert torch.equal(got[key], want[key]), key
    # The probabilities are the same bits; their product with the embedding is a matmul over fewer
    # rows, whose blocking may round differently (as it does today for a different number of
    # canvases going on).
    torch.testing.assert_close(got["soft"], want["soft"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("all_rows", [False, True], ids=["some-canvases", "all-canvases"])
@pytest.mark.parametrize("workspace", WORKSPACES)
def test_tiles_give_the_untiled_results_bit_for_bit(workspace, all_rows):
    logits, u, weight = _inputs()
    want = tiled_sampler(SINGLE, logits.clone(), u, weight, None, all_rows)
    got = tiled_sampler(SINGLE, logits.clone(), u, weight, workspace, all_rows)
    _assert_same(got, want)
    # The self-conditioning product ran a tile at a time: no tile is larger than the workspace allows.
    positions = (CANVASES if all_rows else 2) * CL
    per_tile = max(1, workspace // (8 * VOCAB))
    assert got["tile_positions"] == [min(per_tile, positions - a) for a in range(0, positions, per_tile)]
    assert want["tile_positions"] == [positions]


def test_ranks_tile_to_the_same_results_and_bytes(tp_ranks):
    logits, u, weight = _inputs()
    untiled = tp_ranks.run(tiled_sampler, logits, u, weight, None, gather=True)
    for workspace in (ROW // tp_ranks.size, 4 * ROW // tp_ranks.size):
        tiled = tp_ranks.run(tiled_sampler, logits, u, weight, workspace, gather=True)
        for got, want in zip(tiled, untiled):
            _assert_same(got, want)
            assert (got["step_collectives"], got["step_bytes"]) == (want["step_collectives"], want["step_bytes"])
            assert len(got["tile_positions"]) > 1
