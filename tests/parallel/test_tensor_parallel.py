"""Tensor parallelism with real gloo processes: generation equal to one rank and to transformers,
vocabulary-parallel sampling statistics, bytes moved per step, and clean failure and shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import hf_generate_with_draft, load_hf
from rank_checks import compile_steps_with, compiled_graphs, die_on_rank, fail_on_rank, pid, vocab_statistics

import blockdiff
from blockdiff import LLM, SamplingParams
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext, RankProcesses, WorkerError

GREEDY = dict(t_min=1e-6, t_max=2e-6)
# Odd vocabulary (divides by neither 2 nor 3); sliding layers split 6 KV heads, the full layer's
# single KV head is replicated on every rank; the prompt of 11 tokens outruns the window of 7.
TP_SPEC = dict(
    vocab_size=263, hidden_size=48, intermediate_size=96, num_layers=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_heads=12, num_kv_heads=6,
    head_dim=8, global_head_dim=16, num_global_kv_heads=1, num_experts=4, top_k_experts=2,
    moe_intermediate_size=24, sliding_window=7, canvas_length=8, seed=11,
)
VOCAB = TP_SPEC["vocab_size"]


def _tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_tokens(3, 1), _tokens(11, 2)]
DRAFTS = [_tokens(24, 3), _tokens(24, 4)]


def _greedy(draft, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=22, max_denoising_steps=4, draft=draft, **GREEDY, **extra)


pytestmark = pytest.mark.usefixtures("single_threaded_workers")


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float = 15.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def tp_ckpt(checkpoints):
    return checkpoints("tp", **TP_SPEC)


@pytest.fixture(scope="module")
def one_rank(tp_ckpt):
    """Greedy outputs of one rank, checked once against transformers."""
    with LLM(tp_ckpt) as llm:
        outs = llm.generate(PROMPTS, [_greedy(d, logprobs=3) for d in DRAFTS], use_tqdm=False)
    hf = load_hf(tp_ckpt)
    eos = set(hf.generation_config.eos_token_id)
    for prompt, draft, out in zip(PROMPTS, DRAFTS, outs):
        theirs = hf_generate_with_draft(hf, prompt, draft, max_new_tokens=22, max_denoising_steps=4, **GREEDY)
        cut = next((i + 1 for i, t in enumerate(theirs) if t in eos), 22)
        assert out.token_ids == theirs[:cut]
    return outs


@pytest.mark.parametrize("tp", [2, 3])
def test_greedy_generation_equals_one_rank_and_transformers(tp_ckpt, one_rank, tp):
    with LLM(tp_ckpt, tensor_parallel_size=tp) as llm:
        workers = llm.engine.executor.ranks.run(pid, gather=True)[1:]
        outs = llm.generate(PROMPTS, [_greedy(d, logprobs=3) for d in DRAFTS], use_tqdm=False)
    assert len(workers) == tp - 1 and not _wait_gone(workers, 0)  # shutdown() leaves nothing behind
    for ours, ref in zip(outs, one_rank):
        assert ours.token_ids == ref.token_ids  # == transformers' (checked by the fixture)
        assert ours.metrics["denoising_steps"] == ref.metrics["denoising_steps"]
        # The logprobs are raw (--logprobs-mode's default): the model's log-softmax, before the
        # temperature, from the ranks' all-reduced max and sums; one rank's within 1e-4.
        got, want = ours.outputs[0].token_logprobs, ref.outputs[0].token_logprobs
        assert [list(lp.top) for lp in got] == [list(lp.top) for lp in want]
        for a, b in zip(got, want):
            assert abs(a.logprob - b.logprob) < 1e-4 and all(abs(a.top[t] - b.top[t]) < 1e-4 for t in b.top)
            assert all(-50 < v <= 0 for v in a.top.values())


@pytest.mark.slow  # torch.compile on two ranks: 13 s on a quiet 2-core AVX2 machine
def test_compiled_steps_under_tensor_parallelism_equal_one_rank(tp_ckpt, one_rank):
    """torch.compile(fullgraph=True) traces the step at two ranks: its all-reduces and all-gathers
    are functional collectives inside the graph (the backend's own calls are opaque to dynamo), and
    greedy generation equals one rank's (and so transformers'). The engine's compile options with
    dynamo's graph-only backend (docs/tp.md has inductor's numbers)."""
    with LLM(tp_ckpt, tensor_parallel_size=2, compile=True) as llm:
        ranks = llm.engine.executor.ranks
        ranks.run(compile_steps_with, "eager")
        # (no top logprobs: a step that returns them runs eagerly)
        # one canvas: one shape to trace on each rank
        params = SamplingParams(max_tokens=8, max_denoising_steps=4, draft=DRAFTS[1], **GREEDY)
        outs = llm.generate(PROMPTS[1:], [params], use_tqdm=False)
        graphs = ranks.run(compiled_graphs, gather=True)
    assert outs[0].token_ids == one_rank[1].token_ids[:8]
    assert len(graphs) == 2 and all(len(g) == 1 and g[0] > 0 for g in graphs), graphs  # the collectives are in the graph


def _logits(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(2, 16, vocab, generator=g)
    top = x.max() + 1
    x[0, 0, [5, vocab - 3]] = top  # a tie across ranks
    x[0, 1, [7, 9]] = top  # a tie inside one rank
    x[1, 2, [vocab - 1, vocab - 2]] = top  # a tie on the last rank, beside its padding
    return x


def test_vocab_parallel_statistics_equal_one_rank(tp_ranks):
    logits = _logits(VOCAB)
    u = torch.rand(2, 16, generator=torch.Generator().manual_seed(1))
    u[0, 0], u[0, 1] = 0.0, 1.0 - 2**-24  # the ends of [0, 1)
    single = RankContext(0, 1, torch.device("cpu"), TPGroup())
    want = vocab_statistics(single, logits, u, 5)
    results = tp_ranks.run(vocab_statistics, logits, u, 5, gather=True)
    probs = torch.softmax(logits, dim=-1)
    assert want["argmax"][0, :2].tolist() == [5, 7] and want["argmax"][1, 2] == VOCAB - 2  # ties: lowest id
    for got in results:
        assert (got["entropy"] - want["entropy"]).abs().max() < 1e-5
        assert torch.equal(got["argmax"], want["argmax"]) and torch.equal(got["argmax_alone"], want["argmax"])
        assert torch.equal(got["sample"], want["sample"])
        # torch.topk orders tied values either way: compare (logprob, id) sorted
        assert torch.equal(got["top_ids"].sort(-1).values, want["top_ids"].sort(-1).values)
        assert (got["top_logprobs"] - want["top_logprobs"]).abs().max() < 1e-5
        # each rank's own probabilities P_r, the self-conditioning input, are its slice of softmax
        valid = got["global_ids"] >= 0
        assert (got["local_probs"][..., ~valid] == 0).all()
        assert torch.allclose(got["local_probs"][..., valid], probs[..., got["global_ids"][valid]], atol=1e-6)


def test_vocab_parallel_bytes_do_not_grow_with_the_vocabulary(tp_ranks):
    u = torch.rand(2, 16)
    small = tp_ranks.run(vocab_statistics, _logits(VOCAB), u, 5, gather=True)
    large = tp_ranks.run(vocab_statistics, _logits(16 * VOCAB + 1), u, 5, gather=True)
    assert [r["bytes"] for r in small] == [r["bytes"] for r in large]
    assert 0 < small[0]["bytes"] < 2 * 16 * VOCAB * 4  # less than gathering the smaller logits
    # The sampler's step: the max (fp32), (Σexp, Σexp·y) gathered from each rank (2 fp32), and one
    # all-reduce of (argmax candidate, sampled id) (2 int64) per position.
    n = tp_ranks.size
    assert all(r["step_collectives"] == 3 and r["step_bytes"] == 2 * 16 * (4 + 8 * n + 16) for r in small + large)


def test_bytes_per_denoising_step_do_not_grow_with_the_vocabulary(tp_ckpt, checkpoints):
    """The executor's counter over whole denoising steps (forward, sampler, self-conditioning), per
    step of a launch that runs several (the static step: each computes every canvas's soft embedding)."""
    large = checkpoints("tp-large-vocab", **{**TP_SPEC, "vocab_size": 16 * VOCAB + 1})
    per_step = {}
    for path in (tp_ckpt, large):
        with LLM(path, tensor_parallel_size=2) as llm:
            executor, seen = llm.engine.executor, []
            execute = executor.execute

            counter = executor.ranks.context.group.counter  # what rank 0's collectives moved

            def recording(plan):
                counter.reset()
                out = execute(plan)
                if all(row.decoder for row in plan.rows):
                    assert counter.bytes % plan.steps == 0
                    seen.append(counter.bytes // plan.steps)
                return out

            executor.execute = recording
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, max_denoising_steps=3, seed=0, ignore_eos=True))
        per_step[path] = set(seen)
    assert per_step[tp_ckpt] == per_step[large]
    # docs/tp.md: T · (H·e·(3L + 3 - k) + 20 + 8N), where a canvas's first step has no
    # self-conditioning input (no self-conditioning MLP) and its last computes no soft embedding
    # for a next step: k = 0 in the middle, 1 on the first or the last step, 2 on a step that is both.
    t, h, n = TP_SPEC["canvas_length"], TP_SPEC["hidden_size"], 2
    formula = {t * (h * 4 * (3 * TP_SPEC["num_layers"] + 3 - k) + 20 + 8 * n) for k in (0, 1, 2)}
    assert per_step[large] and per_step[large] <= formula
    assert 0 < max(per_step[large]) < TP_SPEC["canvas_length"] * (16 * VOCAB + 1) * 4  # less than gathering the logits


def test_a_failing_worker_names_its_rank():
    with RankProcesses(2, "cpu") as ranks:
        assert ranks.run(fail_on_rank, -1, gather=True) == [0, 1]
        workers = ranks.run(pid, gather=True)[1:]
        with pytest.raises(WorkerError, match=r"rank 1 failed:(.|\n)*ArithmeticError: deliberate failure on rank 1"):
            ranks.run(fail_on_rank, 1)
        assert not _wait_gone(workers, 0)
        with pytest.raises(WorkerError, match="closed"):
            ranks.run(fail_on_rank, -1)


def test_a_worker_killed_in_a_collective_names_its_rank():
    with RankProcesses(3, "cpu") as ranks:
        pids = ranks.run(pid, gather=True)[1:]
        with pytest.raises(WorkerError, match=rf"^tensor-parallel rank 2 \(pid {pids[1]}\) was killed by SIGKILL"):
            ranks.run(die_on_rank, 2)
        assert not _wait_gone(pids, 0)


def test_a_dead_worker_fails_generation_naming_its_rank(tp_ckpt):
    with LLM(tp_ckpt, tensor_parallel_size=2) as llm:
        (worker,) = llm.engine.executor.ranks.run(pid, gather=True)[1:]
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf"rank 1 \(pid {worker}\) was killed by SIGKILL"):
            llm.generate(PROMPTS[0], _greedy(DRAFTS[0]))
        with pytest.raises(WorkerError, match="closed"):
            llm.generate(PROMPTS[0], _greedy(DRAFTS[0]))


_PARENT = """
import json, sys, threading
from blockdiff import LLM, SamplingParams
from rank_checks import pid  # on sys.path: tests/, which the workers get too

def main(path, how):
    box = []
    start = lambda: box.append(LLM(path, tensor_parallel_size=2))
    if how == "thread":  # no PR_SET_PDEATHSIG then: the socket and the parent watchdog must do
        thread = threading.Thread(target=start)
        thread.start()
        thread.join()
    else:
        start()
    llm = box[0]
    print(json.dumps(llm.engine.executor.ranks.run(pid, gather=True)[1:]), flush=True)
    for _ in range(1000 if how != "exit" else 1):
        llm.generate([5, 6, 7], SamplingParams(max_tokens=16, max_denoising_steps=4, ignore_eos=True))
    # "exit": the interpreter exits without shutdown()

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""


def _env() -> dict:
    """This environment, with this checkout of blockdiff and the tests' helpers importable."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(blockdiff.__file__))
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, tests, env.get("PYTHONPATH")]))
    return env


def _start_parent(path: str, how: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", _PARENT, path, how], stdout=subprocess.PIPE, env=_env(), text=True)
    line = proc.stdout.readline()
    assert line, f"the parent exited with {proc.wait()} before starting its workers"
    return proc, json.loads(line)


@pytest.mark.parametrize("how", ["main", "thread"])
def test_killing_the_parent_leaves_no_worker(tp_ckpt, how):
    parent, workers = _start_parent(tp_ckpt, how)
    try:
        assert workers and all(_alive(p) for p in workers)
        time.sleep(0.5)  # mid-generation
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert not _wait_gone(workers)
    finally:
        parent.kill()
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_interpreter_exit_stops_the_workers(tp_ckpt):
    parent, workers = _start_parent(tp_ckpt, "exit")
    try:
        assert parent.wait(timeout=60) == 0
        assert not _wait_gone(workers, 5)
    finally:
        parent.kill()


def test_cli_generates_with_tensor_parallelism(tp_ckpt):
    draft = ",".join(map(str, DRAFTS[1]))
    cmd = [sys.executable, "-m", "blockdiff", "generate", "--model", tp_ckpt, "-tp", "2", "--json", "--max-tokens", "22",
           "--max-denoising-steps", "4", "--t-min", "1e-6", "--t-max", "2e-6", "--draft", draft, "x"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    with LLM(tp_ckpt) as llm:
        want = llm.generate("x", _greedy(DRAFTS[1]))[0].token_ids
    assert json.loads(out.stdout)["outputs"][0]["token_ids"] == want


def test_model_that_does_not_split_is_a_value_error(tp_ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size=5: 12 attention heads cannot be split over 5 ranks"):
        LLM(tp_ckpt, tensor_parallel_size=5)


def test_the_fast_mode_under_tensor_parallelism_gives_one_rank_tokens(tp_ckpt):
    """The fast denoising mode (settled positions, steps over the active rows only, kept K/V per
    rank's KV heads) decides the same on every rank: two ranks commit one rank's tokens, step for
    step and row for row."""
    params = [SamplingParams(max_tokens=22, max_denoising_steps=8, confidence_threshold=0.0, denoising_mode="fast",
                             settle_steps=1, seed=s, **GREEDY) for s in (1, 2)]
    runs = {}
    for tp in (1, 2):
        with LLM(tp_ckpt, tensor_parallel_size=tp) as llm:
            runs[tp] = llm.generate(PROMPTS, params, use_tqdm=False)
    for ours, ref in zip(runs[2], runs[1]):
        assert ours.token_ids == ref.token_ids
        for key in ("denoising_steps", "canvas_positions_evaluated"):
            assert ours.metrics[key] == ref.metrics[key], key
    canvas = TP_SPEC["canvas_length"]
    assert any(r.metrics["canvas_positions_evaluated"] < r.metrics["denoising_steps"] * canvas for r in runs[1]), \
        "no step ran fewer rows than its canvas: the test proves nothing"
