"""vLLM's penalties and OpenAI's logit_bias on one rank's logits (blockdiff/worker/penalties.py),
against vLLM's formulas in float64: what counts (the prompt, the committed output), per slot, in
tiles, on vocabulary shards, and a neutral request's logits left exactly as they were."""

from __future__ import annotations

import pytest
import torch
from helpers import vllm_penalized

from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.model.attention_layout import Row
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard
from blockdiff.step import NewRequests, Penalties
from blockdiff.worker.penalties import SlotPenalties

V, CL, SLOTS = 37, 4, 4


def _penalties(rep=1.0, presence=0.0, frequency=0.0, prompt=(), output=(), bias=None) -> Penalties:
    bias = bias or {}
    return Penalties(rep, presence, frequency, torch.tensor(prompt, dtype=torch.long),
                     torch.tensor(output, dtype=torch.long), torch.tensor(list(bias), dtype=torch.long),
                     torch.tensor(list(bias.values()), dtype=torch.float32))


def _admit(pen: SlotPenalties, slots: list[int], penalties: list[Penalties | None]) -> None:
    pen.admit(NewRequests(slots, [0] * len(slots), None, None, penalties))


REQUESTS = {
    0: (_penalties(1.7, -0.4, 0.6, prompt=[1, 2, 3, 2], output=[5, 5, 9], bias={3: -100.0, 7: 2.5, 30: 0.25}), [6, 5, 1, 11]),
    1: (None, [4, 4, 4, 4]),  # no penalties: its logits stay as they are
    2: (_penalties(0.5, prompt=[8, 9, 10]), [8, 12, 12, 0]),
}


def _admitted(shard: VocabShard) -> SlotPenalties:
    """Three requests in slots 0-2 (slot 0 readmitted with 3 output tokens committed before), each
    committing a canvas (its encoder row) after its prompt and earlier output."""
    pen = SlotPenalties(SLOTS, shard, torch.device("cpu"))
    _admit(pen, list(REQUESTS), [p for p, _ in REQUESTS.values()])
    rows, ids = [], []
    for slot, (p, canvas) in REQUESTS.items():
        start = 0 if p is None else len(p.prompt) + len(p.output)
        # slot 0's row starts 2 tokens early (its output's last two, recomputed): they count once
        head = [5, 9] if slot == 0 else []
        rows.append(Row(slot, start - len(head), len(head) + len(canvas), False))
        ids += head + canvas
    rows.append(Row(1, 0, CL, True))  # a canvas being denoised: nothing of it counts
    pen.count(rows, torch.tensor(ids, dtype=torch.long))
    return pen


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, CL, V, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("workspace", [None, 64], ids=["one tile", "tiles"])
def test_penalized_logits_are_vllms_in_float64_and_a_neutral_request_keeps_its_logits(workspace):
    shard = VocabShard.make(0, 1, V)
    pen = _admitted(shard)
    logits = _logits()
    out = logits.clone()
    pen.of([0, 1, 2]).apply(out, torch.tensor([0, 1, 2]), VocabParallel(shard, TPGroup(), workspace_bytes=workspace))
    for slot, (p, canvas) in REQUESTS.items():
        if p is None:
            assert torch.equal(out[slot], logits[slot])
            continue
        bias = dict(zip(p.bias_ids.tolist(), p.bias.tolist()))
        want = vllm_penalized(logits[slot], p.prompt.tolist(), p.output.tolist() + canvas, p.repetition, p.presence,
                              p.frequency, bias)
        torch.testing.assert_close(out[slot].double(), want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(out[slot], logits[slot])
    assert (out[0, :, 3] < -90).all()  # the bias of -100
    assert pen.of([1]) is None and pen.of([1, 2]) is pen  # a step of neutral canvases skips the work


def test_each_rank_penalizes_its_own_vocabulary_rows_as_one_rank_does():
    one = _logits(1)
    full = one.clone()
    _admitted(VocabShard.make(0, 1, V)).apply(full, torch.tensor([2, 0, 1]), VocabParallel(VocabShard.make(0, 1, V), TPGroup()))
    for rank in range(2):
        shard = VocabShard.make(rank, 2, V, 0)
        ids = shard.global_ids()
        local = torch.zeros(3, CL, shard.local_rows)
        local[..., ids >= 0] = one[..., ids[ids >= 0]]
        _admitted(shard).apply(local, torch.tensor([2, 0, 1]), VocabParallel(shard, TPGroup()))
        assert torch.equal(local[..., ids >= 0], full[..., ids[ids >= 0]])


def test_a_slot_taken_by_a_request_without_penalties_is_neutral_again():
    shard = VocabShard.make(0, 1, V)
    pen = _admitted(shard)
    _admit(pen, [0], [None])
    logits = _logits(2)
    out = logits.clone()
    pen.apply(out, torch.tensor([0, 1, 2]), VocabParallel(shard, TPGroup()))
    assert torch.equal(out[:2], logits[:2]) and not torch.equal(out[2], logits[2])
    assert pen.of([0, 1]) is None
