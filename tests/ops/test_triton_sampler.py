"""The Triton sampler backend (blockdiff/ops/triton_sampler.py through diffusion/sampler_kernels.py)
against the reference backend, under Triton's interpreter on this CPU (tests/conftest.py), on small
shapes: one rank and the vocabulary shards of 2 and 3 gloo ranks with padding in both the original
and the added ranges, temperature 0 and above, top-k / top-p / min-p, the drawn tokens' logprobs,
the raw logprobs (--logprobs-mode's default) against torch.log_softmax, and the self-conditioning
product, the same draws for the same seeds. Each case is also broken on
purpose (padding unmasked, another random counter, another top-k) to show the comparison fails.

At the real shapes: on a fake H200 (tests/fake_cuda.py), the 26B-A4B static step picks the Triton
backend, calls its kernels, no host sync, no op that CUDA runs nondeterministically; and the
backend's temporaries at vocabulary 262,144 and 16 canvases stay under a quarter of the logits.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from rank_checks import backend_step
from torch.utils._python_dispatch import TorchDispatchMode

from blockdiff.diffusion.entropy_bound import EntropyBound, denoise_params
from blockdiff.diffusion.sampler_kernels import TritonKernels, choose_sampler_backend, sampler_kernels
from blockdiff.diffusion.vocab_parallel import ReferenceKernels, VocabParallel
from blockdiff.ops.sampler_weights import EXP_FLOOR
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext
from blockdiff.parallel.vocab import VocabShard
from blockdiff.sampling_params import REFERENCE_DEFAULTS, SamplingParams
from blockdiff.step import Penalties

SINGLE = RankContext(0, 1, torch.device("cpu"), TPGroup())
CANVASES, CL, ORG, ADDED, HIDDEN = 2, 4, 301, 5, 8  # odd sizes: every shard of 2 and 3 ranks pads


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(CANVASES, CL, ORG + ADDED, generator=g)
    logits[1, 2, [7, ORG + 2]] = logits.max() + 1  # a tie across the ranges: the lowest id wins
    return logits, torch.randn(ORG + ADDED, HIDDEN, generator=g)


def _params(seeds=(11, 12), **fields):
    # every position accepted: each draw shows in the canvas
    p = EntropyBound().resolve(SamplingParams(**{"entropy_bound": 1e3, **fields}), REFERENCE_DEFAULTS)
    return denoise_params([9, 3], [p] * CANVASES, list(seeds))


CASES = {
    "sampled": {},
    "greedy": {"temperature": 0.0},
    "hot": {"temperature": 1.5},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.6},
    "min_p": {"min_p": 0.05},
    "all_cuts": {"top_k": 20, "top_p": 0.8, "min_p": 0.01},
}


def _assert_same(got: dict, want: dict) -> None:
    for key in ("argmax", "canvas", "accepted", "top_ids"):
        assert torch.equal(got[key], want[key]), key
    for key in ("entropy", "total", "logprob", "raw_argmax", "raw_top", "soft"):
        torch.testing.assert_close(got[key], want[key], rtol=2e-5, atol=2e-5, msg=key)


def _differs(got: dict, want: dict) -> bool:
    try:
        _assert_same(got, want)
    except AssertionError:
        return True
    return False


def _run(ranks, *args) -> list[dict]:
    """backend_step(*args) on one rank (None) or on every rank of `ranks`."""
    if ranks is None:
        return [backend_step(SINGLE, *args)]
    return ranks.run(backend_step, *args, gather=True)


@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_matches_the_reference(case):
    logits, weight = _inputs()
    params = _params(**CASES[case])
    want = _run(None, logits.clone(), weight, params, "reference", ADDED)
    got = _run(None, logits.clone(), weight, params, "triton", ADDED)
    _assert_same(got[0], want[0])


@pytest.mark.parametrize("case", ["sampled", "greedy", "all_cuts"])
def test_vocabulary_shards_with_padding_match_the_reference(tp_ranks, case):
    logits, weight = _inputs()
    params = _params(**CASES[case])
    want = _run(tp_ranks, logits, weight, params, "reference", ADDED)
    got = _run(tp_ranks, logits, weight, params, "triton", ADDED)
    for g, w in zip(got, want):
        _assert_same(g, w)
    # ...and the shards' answer is the one-rank answer
    _assert_same(got[0], _run(None, logits.clone(), weight, params, "reference", ADDED)[0])


@pytest.mark.parametrize("case", ["greedy", "hot"])
def test_raw_logprobs_are_the_log_softmax_of_the_logits(tp_ranks, case):
    """Both backends, on one rank and on the shards: the reported logprobs (raw, the default) of the
    argmax and the top tokens are torch.log_softmax of the logits before the temperature, within
    1e-4, at temperature 0 (the schedule scaled by 1e-6) as above it."""
    logits, weight = _inputs()
    want = torch.log_softmax(logits, dim=-1)
    params = _params(**CASES[case])
    for backend in ("reference", "triton"):
        for got in _run(None, logits.clone(), weight, params, backend, ADDED) + _run(tp_ranks, logits, weight, params,
                                                                                     backend, ADDED):
            torch.testing.assert_close(got["raw_argmax"], want.gather(-1, got["argmax"].unsqueeze(-1)).squeeze(-1),
                                       rtol=0, atol=1e-4)
            assert torch.equal(got["top_ids"], want.topk(3, dim=-1).indices)
            torch.testing.assert_close(got["raw_top"], want.topk(3, dim=-1).values, rtol=0, atol=1e-4)


def test_unmasked_padding_changes_the_sharded_result(tp_ranks):
    logits, weight = _inputs()
    params = _params()
    want = _run(tp_ranks, logits, weight, params, "reference", ADDED)
    broken = _run(tp_ranks, logits, weight, params, "triton", ADDED, False)
    assert _differs(broken[0], want[0])


@pytest.mark.parametrize("broken", [{"seeds": (11, 13)}, {"top_k": 2}, {"temperature": 0.0}])
def test_a_broken_case_is_seen(broken):
    """Another random counter (seed), another cut, another temperature: the comparison fails."""
    logits, weight = _inputs()
    want = _run(None, logits.clone(), weight, _params(), "reference", ADDED)
    got = _run(None, logits.clone(), weight, _params(**broken), "triton", ADDED)
    assert _differs(got[0], want[0])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_weight_below_the_floor_is_zero(backend):
    """exp(y) below EXP_FLOOR (under float32's normal range, which the CPU computes ~10x slower) is
    0 in both backends: in the weights, the sums and the entropy (ops/sampler_weights.py)."""
    y = torch.full((2, 300), -100.0)
    y[:, 7] = 0.0
    y[1, 100:110] = EXP_FLOOR + 0.1  # kept: exp is still a normal number
    y[1, 110:120] = EXP_FLOOR - 0.5  # a denormal: dropped
    y[1, 120:130] = -300.0
    vocab = VocabParallel(VocabShard.make(0, 1, 300, 0), TPGroup(), kernels=sampler_kernels(backend))
    weights = vocab.kernels.exp_rows(y, 0, None, torch.empty_like(y))
    kept = y >= EXP_FLOOR
    assert torch.equal(weights[~kept], torch.zeros(int((~kept).sum())))
    torch.testing.assert_close(weights[kept], y[kept].exp(), rtol=1e-6, atol=0)
    d = vocab.distribution(y.clone())
    assert torch.equal(d.total, torch.ones(2))
    # a row whose every other token is below the floor has entropy 0, not the ~1e-33 of its denormals
    assert d.entropy[0].item() == 0.0
    torch.testing.assert_close(d.entropy[1], -(10 * (EXP_FLOOR + 0.1) * torch.tensor(EXP_FLOOR + 0.1).exp()),
                               rtol=1e-5, atol=0)


def test_choose_sampler_backend(monkeypatch):
    assert choose_sampler_backend("cpu") == "reference"
    assert choose_sampler_backend(torch.device("cuda")) == "triton"
    assert choose_sampler_backend("cuda", "reference") == "reference"
    assert isinstance(sampler_kernels("triton"), TritonKernels) and type(sampler_kernels("reference")) is ReferenceKernels
    with pytest.raises(ValueError, match="choose one of"):
        choose_sampler_backend("cuda", "flash")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_sampler_backend("cpu", "triton") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on CUDA"):
        choose_sampler_backend("cpu", "triton")


class Allocations(TorchDispatchMode):
    """The bytes of the tensors the ops it sees allocate (outputs that alias no input) that are
    alive at once, at the most: what a backend holds beside the logits."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [r.alias_info is None for r in func._schema.returns]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t, new in zip(outs, fresh):
            if new and isinstance(t, torch.Tensor):
                n = t.untyped_storage().nbytes()
                self.live += n
                weakref.finalize(t, self._free, n)
        self.peak = max(self.peak, self.live)
        return out


def _sampler_peak(kernels, canvases: int) -> tuple[int, int]:
    """(peak bytes beside the logits, the logits' bytes) of a restricted step's distribution, draw,
    logprobs and self-conditioning product at the 26B-A4B vocabulary, on a fake H200."""
    from fake_cuda import fake_cuda

    vocab_size, cl, hidden = 262_144, 256, 2816
    with fake_cuda():
        vocab = VocabParallel(VocabShard.make(0, 1, vocab_size), TPGroup(), "cuda", workspace_bytes=2**30, kernels=kernels)
        logits = torch.empty(canvases, cl, vocab_size, device="cuda")
        weight = torch.empty(vocab_size, hidden, dtype=torch.bfloat16, device="cuda")
        u = torch.empty(canvases, cl, device="cuda")
        k = torch.full((canvases,), 50, dtype=torch.int32, device="cuda")
        p, lowest = torch.full((canvases,), 0.9, device="cuda"), torch.full((canvases,), 0.01, device="cuda")
        with Allocations() as seen:
            d = vocab.distribution(logits)
            draw = vocab.restricted_draw(d, k, p, lowest)
            argmax, sample = vocab.argmax_and_sample(d, u, draw)
            vocab.token_logprob(d, sample)
            vocab.soft_embed(d, None, lambda probs, total: (probs.to(torch.bfloat16) @ weight) / total.unsqueeze(-1),
                             torch.bfloat16)
    return seen.peak, logits.numel() * 4


def test_triton_temporaries_stay_under_a_quarter_of_the_logits():
    peak, logits = _sampler_peak(TritonKernels(), 16)
    assert peak <= logits // 4, f"{peak / 2**30:.2f} GiB beside {logits / 2**30:.2f} GiB of logits"
    # The same count catches a backend that keeps [positions, vocabulary] temporaries: the reference's.
    reference, _ = _sampler_peak(ReferenceKernels(), 16)
    assert reference > logits // 4


# What torch.use_deterministic_algorithms names nondeterministic on CUDA (torch/__init__.py), by op.
NONDETERMINISTIC = {"aten::index_add", "aten::index_add_", "aten::scatter_add", "aten::scatter_add_", "aten::scatter",
                    "aten::scatter_", "aten::scatter_reduce", "aten::scatter_reduce_", "aten::put_", "aten::histc",
                    "aten::bincount", "aten::median", "aten::index_put_", "aten::_index_put_impl_"}
FLOAT_SCANS = {"aten::cumsum", "aten::cumsum_", "aten::cumprod", "aten::cumprod_"}


class OpLog(TorchDispatchMode):
    """The ops called, and those of them CUDA runs nondeterministically."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()
        self.nondeterministic: list[str] = []
        self.entered: set[str] = set()  # the functions logged that ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.ops.add(name)
        if name in NONDETERMINISTIC or (name in FLOAT_SCANS and args[0].is_floating_point()):
            self.nondeterministic.append(f"{name} on {args[0].dtype} {tuple(args[0].shape)}")
        return func(*args, **(kwargs or {}))


def _logged_static_step(top_k: int, penalties=None) -> tuple[OpLog, object, object]:
    """The 26B-A4B static step of three canvases (tests/ops/test_fake_cuda.py) with top_k, on a fake
    H200, no host read allowed, the sampler's part (penalties, step and self-conditioning) under an
    OpLog. `penalties`: the first canvas's request's (step.Penalties), or None."""
    from fake_cuda import NoHostReads, fake_cuda
    from test_fake_cuda import _canvas_rows, _runner

    from helpers import new_requests, whole_tables
    from blockdiff.worker.canvas_step import CanvasSteps

    log = OpLog()
    with fake_cuda((9, 0)), pytest.MonkeyPatch.context() as patch:
        runner = _runner(1)
        for obj, name in ((runner.sampler, "step"), (runner.vocab, "soft_embed"), (runner.penalties, "apply")):
            def logged(*args, _original=getattr(obj, name), _name=name, **kwargs):
                log.entered.add(_name)
                with log:
                    return _original(*args, **kwargs)
            patch.setattr(obj, name, logged)
        steps = CanvasSteps(runner.model, runner.sampler, runner.vocab, runner.kv, runner.geometry, runner.tables.tables,
                            runner.state, runner.requests, runner.device, compile=False, cuda_graphs=False,
                            penalties=runner.penalties)
        rows = _canvas_rows(runner.canvas_length)
        p = EntropyBound().resolve(SamplingParams(top_k=top_k), REFERENCE_DEFAULTS)
        params = denoise_params([16] * len(rows), [p] * len(rows), list(range(len(rows))))
        runner.tables.apply(whole_tables(rows))
        admitted = new_requests(rows, [16] * len(rows), [p] * len(rows), list(range(len(rows))))
        runner.requests.admit(admitted)
        if penalties is not None:
            admitted.penalties = [penalties] + [None] * (len(rows) - 1)
            runner.penalties.admit(admitted)
        with NoHostReads():
            _, out = steps(rows, params.options())
    return log, runner, out


def test_static_step_on_a_fake_h200_runs_the_triton_sampler():
    log, runner, out = _logged_static_step(top_k=40)
    assert runner.vocab.kernels.name == "triton"
    assert {f"blockdiff::sampler_{k}" for k in ("chunk_max", "exp_statistics", "first_argmax", "inverse_cdf",
                                                 "count_at_least", "mass_above", "kept_cumsum", "exp_rows",
                                                 "row_cumsum")} <= log.ops
    assert not log.nondeterministic
    assert out.updates["soft"].dtype == torch.bfloat16 and out.tokens.is_cuda


def test_static_step_with_penalties_on_a_fake_h200_reads_nothing_back_and_runs_no_nondeterministic_op():
    """Penalties and logit_bias in the static step (worker/penalties.py) before the Triton sampler:
    gathered per slot and applied elementwise, no scatter, no host read."""
    penalties = Penalties(1.2, 0.5, 0.3, torch.tensor([5, 9, 9]), torch.tensor([7, 7, 200_000]), torch.tensor([3, 100]),
                          torch.tensor([-100.0, 2.0]))
    log, runner, out = _logged_static_step(top_k=-1, penalties=penalties)
    assert runner.vocab.kernels.name == "triton" and runner.penalties.of([0]) is runner.penalties
    assert "apply" in log.entered  # the penalties ran inside the step
    assert not log.nondeterministic
    assert out.tokens.is_cuda


def test_the_op_log_sees_a_nondeterministic_op():
    """The check can fail: the reference backend's float cumsum in the same step is caught."""
    from blockdiff.worker import model_runner

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "choose_sampler_backend", lambda device: "reference")
        log, runner, _ = _logged_static_step(top_k=40)
    assert runner.vocab.kernels.name == "reference"
    assert any(op.startswith("aten::cumsum on torch.float32") for op in log.nondeterministic)


def test_the_whole_static_step_on_a_fake_h200_calls_no_op_cuda_runs_nondeterministically():
    """Every aten op of the 26B-A4B static step on a fake H200 (the model's forward with its MoE
    combine, the Triton attention and sampler backends, the commit): none that CUDA runs with
    atomics, so a seed gives the same tokens in any batch there as on the CPU."""
    from fake_cuda import NoHostReads, fake_cuda
    from test_fake_cuda import _canvas_rows, _runner

    from helpers import new_requests, whole_tables
    from blockdiff.worker.canvas_step import CanvasSteps

    log = OpLog()
    with fake_cuda((9, 0)):
        runner = _runner(1)
        steps = CanvasSteps(runner.model, runner.sampler, runner.vocab, runner.kv, runner.geometry, runner.tables.tables,
                            runner.state, runner.requests, runner.device, compile=False, cuda_graphs=False)
        rows = _canvas_rows(runner.canvas_length)
        p = EntropyBound().resolve(SamplingParams(top_k=40), REFERENCE_DEFAULTS)
        params = denoise_params([16] * len(rows), [p] * len(rows), list(range(len(rows))))
        runner.tables.apply(whole_tables(rows))
        runner.requests.admit(new_requests(rows, [16] * len(rows), [p] * len(rows), list(range(len(rows)))))
        with NoHostReads(), log:
            steps(rows, params.options())
    assert runner.geometry.backend == "triton" and runner.vocab.kernels.name == "triton"
    assert "blockdiff::paged_attention" in log.ops and len(log.ops) > 20
    assert not log.nondeterministic, log.nondeterministic
