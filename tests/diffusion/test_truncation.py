"""top_k, top_p and min_p restrict the candidate draw as vLLM applies them (min-p, then top-k, then
top-p over what is left), exactly, on one rank and on real gloo ranks; greedy decoding and the
other outputs do not change. (Their out-of-range values are refused: tests/unit/test_sampling_params.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rank_checks import record_restricted_draws, recorded_draws, restricted_draw, vocab_statistics

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


def _recorded_generation(path: str, params: list[SamplingParams], **options) -> tuple[list[list[int]], list[list[dict]]]:
    """The tokens, and per rank what each restricted draw ran on and drew (rank_checks.record_restricted_draws)."""
    with LLM(path, **options) as llm:
        ex = llm.engine.executor
        ranks = getattr(ex, "ranks", None)
        if ranks is None:
            context = SimpleNamespace(state={"runner": ex.runner})
            record_restricted_draws(context)
        else:
            ranks.run(record_restricted_draws)
        tokens = [o.token_ids for o in llm.generate([[2, 17, 30], [2, 40]], params, use_tqdm=False)]
        return tokens, [recorded_draws(context)] if ranks is None else ranks.run(recorded_draws, gather=True)


def _full_vocabulary(shards: list[dict], key: str) -> torch.Tensor:
    """[canvases, CL, V] one step's `key` (shifted logits, kept mask), put together from every rank's shard."""
    full = torch.full((*shards[0][key].shape[:-1], VOCAB), torch.nan)
    for s in shards:
        real = s["ids"] >= 0
        full[..., s["ids"][real]] = s[key][..., real].float()
    assert not full.isnan().any()
    return full if key != "kept" else full.bool()


# Rounding slack for the exact reference: a float32 sum of at most VOCAB positive weights is within
# VOCAB * 2^-24 < 1.6e-5 of the exact one, relative to the total (1-ulp differences of exp included).
TIE = 1e-4


def _exact_draw(shifted: torch.Tensor, u: torch.Tensor, top_k: int, top_p: float, min_p: float):
    """vLLM's min-p, top-k, top-p and the inverse-CDF draw (first id whose cumulative weight in id
    order exceeds u · total) in float64, for positions [n, V]: (kept [n, V], sample [n], plain [n]: the
    unrestricted draw for the same u, decided [n]: no cut or draw within TIE of a tie, so that any
    summation order must agree with it)."""
    e = shifted.double().exp()
    e = e / e.amax(-1, keepdim=True)
    decided = ((e - min_p).abs() >= TIE).all(-1)
    keep = e >= min_p
    desc = torch.where(keep, e, 0.0).sort(-1, descending=True).values
    if 0 < top_k < VOCAB:
        kth, after = desc[:, top_k - 1 : top_k], desc[:, top_k : top_k + 1]
        decided &= ((kth - after) >= TIE * kth).squeeze(-1) | (after == 0).squeeze(-1)
        keep &= e >= kth
    w = torch.where(keep, e, 0.0)
    total = w.sum(-1, keepdim=True)
    if top_p < 1:  # a token is kept when the kept weight strictly above it is below top_p of the total
        above = torch.where(w.unsqueeze(1) > w.unsqueeze(-1), w.unsqueeze(1), 0.0).sum(-1)
        gap = (above - top_p * total).abs().masked_fill(~keep, torch.inf)
        decided &= (gap >= TIE * total).all(-1)
        keep &= above < top_p * total
        w = torch.where(keep, e, 0.0)
        total = w.sum(-1, keepdim=True)

    def draw(weights, mass):
        cum, target = weights.cumsum(-1), u.double().unsqueeze(-1) * mass
        return torch.searchsorted(cum, target, right=True).squeeze(-1), ((cum - target).abs() >= TIE * mass).all(-1)

    sample, clear = draw(w, total)
    plain, _ = draw(e, e.sum(-1, keepdim=True))
    return keep, sample, plain, decided & clear


@pytest.mark.slow  # two engines, the second of two ranks: ~15 s on a loaded 2-core machine
def test_seeded_generation_on_two_ranks_equals_one_rank(restricted_ckpt, single_threaded_workers):
    """Seeded restricted sampling through the engine, on one rank and on two worker processes:
    every step's candidates are the draw that top_k + min_p and top_p make from that step's logits
    and random numbers. The two runs' tokens are not compared: at two ranks the row-parallel
    all-reduces add in another order, and on a random model (near-uniform distributions) a last-bit
    difference can move a token across a top-p or draw boundary, which changes the rest of the
    sequence. So each run's draws are checked against the exact (float64) rule on the logits it
    had, skipping the rare positions within TIE of a tie, where float32 sums in any order may go
    either way; at two ranks both ranks must draw the same bits, and one rank's sampler
    (VocabParallel on a group of one) must draw the same from the logits the ranks had."""
    seeded = [SamplingParams(max_tokens=16, max_denoising_steps=4, seed=s, ignore_eos=True, t_min=1.5, t_max=3.0, **k)
              for s, k in ((1, dict(top_k=4, min_p=0.02)), (2, dict(top_p=0.7)))]
    asked = {(4, 1.0, float(torch.tensor(0.02))), (-1, float(torch.tensor(0.7)), 0.0)}  # (top_k, top_p, min_p) in float32
    runs = {tp: _recorded_generation(restricted_ckpt, seeded, tensor_parallel_size=tp) for tp in (1, 2)}
    first_u = [runs[tp][1][0][0]["u"] for tp in (1, 2)]
    assert torch.equal(*first_u)  # the seeded randoms are every rank count's alike
    positions = decided = differ = 0
    seen = set()
    for tp, (tokens, per_rank) in runs.items():
        assert len(tokens) == 2 and all(len(t) == 16 for t in tokens)
        steps = per_rank[0]
        assert len(steps) >= 2 and all(len(r) == len(steps) for r in per_rank)
        for i, step in enumerate(steps):
            for other in per_rank[1:]:  # every rank keeps and draws the same
                assert all(torch.equal(other[i][k], step[k]) for k in ("threshold", "argmax", "sample"))
            shifted, kept = (_full_vocabulary([r[i] for r in per_rank], key) for key in ("shifted", "kept"))
            # each canvas's own knobs, as the engine passed them (a step may hold one request's canvas only)
            knobs = [(int(k), float(p), float(m)) for k, p, m in zip(step["top_k"], step["top_p"], step["min_p"])]
            assert set(knobs) <= set(asked) and len(knobs) == len(shifted)
            seen.update(knobs)
            one = restricted_draw(SINGLE, shifted.clone(), step["u"], *_split(knobs))
            assert kept.gather(-1, step["sample"].unsqueeze(-1)).all()  # every candidate is a kept token
            for c, (k, p, m) in enumerate(knobs):
                want_kept, want, plain, ok = _exact_draw(shifted[c], step["u"][c], k, p, m)
                assert torch.equal(kept[c][ok], want_kept[ok]), (tp, i, c)
                assert torch.equal(step["sample"][c][ok], want[ok]), (tp, i, c)
                assert torch.equal(one["kept"][c][ok], want_kept[ok]) and torch.equal(one["sample"][c][ok], want[ok])
                assert (want_kept.sum(-1) <= (k if k > 0 else VOCAB - 1)).all()  # the cut is in effect
                positions, decided, differ = positions + ok.numel(), decided + int(ok.sum()), differ + int((want != plain)[ok].sum())
    # Ties are rare: nearly every draw is checked, and the restriction changes many of them.
    assert seen == asked
    assert decided >= 0.8 * positions and differ >= 0.25 * decided, (positions, decided, differ)
