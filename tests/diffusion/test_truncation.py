"""top_k, top_p and min_p restrict the candidate draw as vLLM applies them (min-p, then top-k, then
top-p over what is left), exactly, on one rank and on real gloo ranks; greedy decoding and the
other outputs do not change. (Their out-of-range values are refused: tests/unit/test_sampling_params.py.)"""

from __future__ import annotations

import pytest
import torch
from rank_checks import restricted_draw, vocab_statistics

from blockdiff import LLM, SamplingParams
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext

SINGLE = RankContext(0, 1, torch.device("cpu"), TPGroup())
VOCAB, CL = 263, 6
U_MAX = 1.0 - 2**-24
# Per canvas (top_k, top_p, min_p): off; each alone; all three; k beyond the vocabulary.
KNOBS = [(-1, 1.0, 0.0), (7, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.05), (20, 0.8, 0.01), (VOCAB + 5, 1.0, 0.0)]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(len(KNOBS), CL, VOCAB, generator=g)
    u = torch.rand(len(KNOBS), CL, generator=g)
    u[:, 0], u[:, 1] = 0.0, U_MAX
    return logits, u


def _vllm_kept(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """vLLM's masks (Sampler: min-p on the probabilities, then apply_top_k_top_p's sort), float64."""
    probs = torch.softmax(logits.double(), dim=-1)
    keep = probs >= min_p * probs.amax(-1, keepdim=True)
    masked = torch.where(keep, logits.double(), -torch.inf)
    if top_k > 0:
        kth = masked.sort(-1, descending=True).values[..., min(top_k, VOCAB) - 1 : min(top_k, VOCAB)]
        masked = torch.where(masked >= kth, masked, -torch.inf)
    if top_p < 1:
        p_sort, order = torch.softmax(masked, -1).sort(-1)
        drop = p_sort.cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        masked = masked.scatter(-1, order, torch.where(drop, -torch.inf, masked.gather(-1, order)))
    return masked > -torch.inf


def _split(knobs):
    return [list(x) for x in zip(*knobs)]


def test_kept_tokens_are_vllms_and_every_draw_is_one_of_them():
    logits, u = _inputs()
    got = restricted_draw(SINGLE, logits.clone(), u, *_split(KNOBS))
    e = (logits - logits.amax(-1, keepdim=True)).exp()
    for i, knobs in enumerate(KNOBS):
        kept = e[i] >= got["threshold"][i].unsqueeze(-1)
        assert torch.equal(kept, _vllm_kept(logits[i], *knobs)), knobs
        assert kept.gather(-1, got["sample"][i].unsqueeze(-1)).all()
    counts = (e >= got["threshold"].unsqueeze(-1)).sum(-1)
    assert (counts[1] == 7).all() and (counts[0] == VOCAB).all() and (counts[5] == VOCAB).all()


def test_restriction_changes_only_the_restricted_canvases_draws():
    logits, u = _inputs(1)
    plain = vocab_statistics(SINGLE, logits.clone(), u, 1)
    got = restricted_draw(SINGLE, logits.clone(), u, *_split(KNOBS))
    assert torch.equal(got["argmax"], plain["argmax"])
    for i in (0, 5):  # nothing to cut: the same draws, bit for bit
        assert torch.equal(got["sample"][i], plain["sample"][i])
    assert not torch.equal(got["sample"][1:5], plain["sample"][1:5])


@pytest.mark.parametrize("workspace", [VOCAB * 9, 5 * VOCAB * 9])
def test_tiles_draw_the_same(workspace):
    logits, u = _inputs(2)
    want = restricted_draw(SINGLE, logits.clone(), u, *_split(KNOBS))
    got = restricted_draw(SINGLE, logits.clone(), u, *_split(KNOBS), workspace)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_ranks_keep_and_draw_what_one_rank_does(tp_ranks):
    logits, u = _inputs(3)
    want = restricted_draw(SINGLE, logits.clone(), u, *_split(KNOBS))
    for got in tp_ranks.run(restricted_draw, logits, u, *_split(KNOBS), gather=True):
        assert torch.equal(got["threshold"], want["threshold"])
        assert torch.equal(got["argmax"], want["argmax"]) and torch.equal(got["sample"], want["sample"])


@pytest.fixture(scope="module")
def restricted_ckpt(checkpoints):
    return checkpoints("restricted", vocab_size=263, canvas_length=8, sliding_window=6, seed=4)


def _generate(path: str, params: list[SamplingParams], **options) -> list[list[int]]:
    with LLM(path, **options) as llm:
        return [o.token_ids for o in llm.generate([[2, 17, 30], [2, 40]], params, use_tqdm=False)]


def test_greedy_is_unchanged(restricted_ckpt):
    greedy = dict(max_tokens=16, max_denoising_steps=4, temperature=0, ignore_eos=True)
    plain = _generate(restricted_ckpt, [SamplingParams(**greedy)] * 2)
    cut = _generate(restricted_ckpt, [SamplingParams(**greedy, top_k=3, top_p=0.5, min_p=0.2)] * 2)
    assert cut == plain


@pytest.mark.slow  # ~50 s: three engines, one of two ranks (the draw's TP equality is checked fast above)
def test_seeded_generation_on_two_ranks_equals_one_rank(restricted_ckpt, single_threaded_workers):
    seeded = [SamplingParams(max_tokens=16, max_denoising_steps=4, seed=s, ignore_eos=True, t_min=1.5, t_max=3.0, **k)
              for s, k in ((1, dict(top_k=4, min_p=0.02)), (2, dict(top_p=0.7)))]
    one = _generate(restricted_ckpt, seeded)
    assert one == _generate(restricted_ckpt, seeded, tensor_parallel_size=2)
    assert one != _generate(restricted_ckpt, [SamplingParams(**{**p.__dict__, "top_k": None, "top_p": None, "min_p": None})
                                              for p in seeded])
