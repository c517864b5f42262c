"""The self-conditioning helper soft_embedding: P @ W * scale on one rank, sum_r P_r @ W_r sharded."""

from __future__ import annotations

import pytest
import torch
from rank_checks import local_columns, local_rows, sharded_soft_embedding
from torch.utils._python_dispatch import TorchDispatchMode

from blockdiff.parallel.self_conditioning import soft_embedding
from blockdiff.ops.matmul import linear
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard

ORG, ADDED, HIDDEN = 301, 5, 24  # neither vocabulary range divides by 2, 3 or 4
SCALE = float(torch.tensor(HIDDEN**0.5))


def _inputs(vocab: int = ORG + ADDED, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(2, 5, vocab, generator=g), dim=-1)
    weight = torch.randn(vocab, HIDDEN, generator=g)
    return probs, weight


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_full_vocabulary_is_p_at_w_times_scale():
    probs, weight = _inputs()
    out = soft_embedding(probs, weight, SCALE)
    assert torch.equal(out, linear(probs, weight.t()) * SCALE)  # the engine's matmul kernel
    exact = (probs.double() @ weight.double()) * SCALE
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_one_rank_is_one_matmul_and_the_scale():
    """On one rank: no slicing, no copy, no collective; only views besides the matmul for 3-D probs."""
    probs, weight = _inputs()
    group = TPGroup()
    rows = probs[0]
    views = ("view", "_unsafe_view", "t", "transpose")
    with OpRecorder() as product:  # the matmul kernel of this device (blockdiff/ops/matmul.py)
        linear(rows, weight.t())
    matmul = [op for op in product.ops if op not in views]
    assert len(matmul) == 1
    with OpRecorder() as flat:
        soft_embedding(rows, weight, SCALE, group=group)
    assert [op for op in flat.ops if op not in views] == matmul + ["mul"]
    with OpRecorder() as batched:
        soft_embedding(probs, weight, SCALE, group=group)
    assert [op for op in batched.ops if op not in views] == matmul + ["mul"]
    with OpRecorder() as one_shard:  # what the engine passes on one rank
        soft_embedding(probs, weight, SCALE, VocabShard.make(0, 1, ORG, ADDED), group)
    assert [op for op in one_shard.ops if op not in views] == matmul + ["mul"]
    assert group.counter.calls == 0


@pytest.mark.parametrize("local_probs", [False, True], ids=["full-probs", "local-probs"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_simulated_shards_sum_to_the_full_result(size, local_probs):
    """Each rank's result (no group: the partial sum before the all-reduce) from its rows; padding
    rows hold garbage that must not reach the sum."""
    probs, weight = _inputs()
    full = soft_embedding(probs, weight, SCALE)
    total = torch.zeros_like(full)
    owned = []
    for rank in range(size):
        shard = VocabShard.make(rank, size, ORG, ADDED)
        w = local_rows(shard, weight)
        w[~shard.valid_rows()] = 1e3
        p = local_columns(shard, probs) if local_probs else probs
        total += soft_embedding(p, w, SCALE, shard)
        owned += shard.global_ids()[shard.valid_rows()].tolist()
    assert sorted(owned) == list(range(ORG + ADDED))  # the shards cover the vocabulary once
    assert ORG % size and ADDED % size  # padding in both ranges
    assert torch.allclose(total, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("local_probs", [False, True], ids=["full-probs", "local-probs"])
def test_real_ranks_all_reduce_to_the_full_result(tp_ranks, local_probs):
    probs, weight = _inputs(seed=1)
    full = soft_embedding(probs, weight, SCALE)
    results = tp_ranks.run(sharded_soft_embedding, probs, weight, SCALE, ORG, ADDED, local_probs, gather=True)
    assert len(results) == tp_ranks.size
    for out in results:
        assert torch.equal(out, results[0])  # every rank holds the same soft embeddings
    assert torch.allclose(results[0], full, rtol=1e-5, atol=1e-5)


def test_vocabulary_mismatch_names_both_sizes():
    probs, weight = _inputs()
    with pytest.raises(ValueError, match=rf"{ORG + ADDED} tokens.*{ORG} rows"):
        soft_embedding(probs, weight[:ORG], SCALE)
    shard = VocabShard.make(0, 2, ORG, ADDED)
    with pytest.raises(ValueError, match=rf"cover 300 tokens.*\({ORG + ADDED}\).*{shard.local_rows} rows"):
        soft_embedding(probs[..., :300], local_rows(shard, weight), SCALE, shard)
