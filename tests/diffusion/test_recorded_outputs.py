"""Seeded outputs of the entropy-bound sampler against a recording: tokens, logprobs and step
counts, bit for bit, through the eager forward over rows and through the static canvas step run
eagerly (the same bits: attention's result for a query depends on its own keys only), at two
tensor-parallel ranks (gloo), several steps per launch, on the tiny checkpoint and on the demo model.

Recorded first from the code before the sampler became a strategy; re-recorded once for the one
change of seeded outputs allowed since: attention reduces over fixed key blocks in
position order (so a recomputed prefix caches the same bits), which moves the logits in their last
bits, and every random number is counted on the device by (seed, canvas, step, position)
(diffusion/randoms.py) instead of drawn from a host generator per request. The logprobs alone were
re-recorded once more: they are raw by default (--logprobs-mode raw_logprobs, vLLM's), the model's
log-softmax before the temperature; every token, top-alternative id, finish reason and step count
stayed as recorded.

**The kernels are pinned, so the recording is a property of the code, not of the CPU.** A random
tiny model's distributions are nearly flat: a difference in the last bit of one logit moves an
inverse-CDF draw, and the next canvases follow it. With each library's own choice of kernels the
outputs differ between CPUs: ATen's AVX-512 exp against its AVX2 one, oneDNN's float32 products
(blockdiff/ops/matmul.py takes them where ATen reports AVX-512) against MKL's, MKL's AVX-512 sgemm on
Intel against the AVX2 one it runs on AMD. So the outputs are computed in a child process whose
kernels every x86-64 CPU that CI may run on (AMD Zen 3 to 5, Intel Xeons with AVX-512 and AMX)
computes the same way: ATen's AVX2 kernels (ATEN_CPU_CAPABILITY), oneDNN capped at AVX2, MKL in its
conditional-numerical-reproducibility mode COMPATIBLE (MKL_CBWR: the same bits on every x86
processor), one thread. The tiny checkpoint is made in that process too (its random weights come
from vectorized kernels).

The recording is data/recorded_outputs.json; `python tests/diffusion/test_recorded_outputs.py` rewrites it
(only ever from code whose outputs are known to be right), under the same pinned kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from blockdiff import LLM, SamplingParams
from blockdiff.model.tiny import TinySpec, make_tiny_model
from blockdiff.worker.canvas_step import CanvasSteps

RECORDING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "recorded_outputs.json")
TINY = dict(vocab_size=301, canvas_length=8, sliding_window=6, seed=1)  # conftest's `tiny`
# Kernels that every x86-64 CPU computes the same way (the module's docstring says why each).
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "COMPATIBLE",
                    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
RECORDED = ["tiny_eager", "tiny_alone", "tiny_static", "tiny_tp2", "demo_eager"]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 301, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Requests that cover the sampler's branches: several canvases, early stops (stability and
# confidence), a scaled schedule, greedy decoding, top-k / top-p / min-p draws, logprobs and a draft.
TINY_REQUESTS = [
    (_prompt(5, 0), dict(max_tokens=20, max_denoising_steps=6, seed=11, ignore_eos=True, logprobs=2)),
    (_prompt(13, 1), dict(max_tokens=17, max_denoising_steps=9, seed=12, ignore_eos=True, entropy_bound=0.8,
                          stability_threshold=2, confidence_threshold=6.0, logprobs=0)),
    (_prompt(3, 2), dict(max_tokens=24, max_denoising_steps=5, seed=13, ignore_eos=True, temperature=0.6,
                         top_k=20, top_p=0.9, min_p=0.01)),
    (_prompt(9, 3), dict(max_tokens=16, max_denoising_steps=10, seed=14, temperature=0, draft=[7] * 10)),
    (_prompt(7, 4), dict(max_tokens=12, max_denoising_steps=7, seed=15, ignore_eos=True, t_min=0.2, t_max=1.5)),
]
DEMO_REQUESTS = [
    ("12+30=", dict(max_tokens=32, max_denoising_steps=8, seed=3, logprobs=1)),
    ("reverse: hello", dict(max_tokens=16, seed=4)),
]


def _outputs(llm: LLM, requests) -> list[dict]:
    prompts = [p for p, _ in requests]
    params = [SamplingParams(**kw) for _, kw in requests]
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        out.append({
            "token_ids": o.token_ids,
            "logprobs": None if (lps := o.outputs[0].token_logprobs) is None else [[lp.logprob, sorted(lp.top.items())] for lp in lps],
            "finish_reason": o.finish_reason,
            "canvases": o.metrics["canvases"],
            "denoising_steps": o.metrics["denoising_steps"],
        })
    return json.loads(json.dumps(out))  # top-logprob pairs as lists, like the recording


def _static_steps(llm: LLM) -> None:
    """Steps of canvases only through worker/canvas_step.py, run eagerly (on this CPU only
    --compile reaches it otherwise)."""
    r = llm.engine.executor.runner
    r.canvas_steps = CanvasSteps(r.model, r.sampler, r.vocab, r.kv, r.geometry, r.tables.tables, r.state, r.requests,
                                 r.device, False, False)


def _run_all(tiny: str) -> dict:
    """The recorded runs, one step per launch (num_scheduler_steps=1) except at two ranks (the CPU's
    default number of steps per launch, whose outputs are those of one step at a time), and the
    unrecorded ones that must equal them: five steps per launch, and the first request reseeded
    (which must not)."""
    got = {}
    with LLM(tiny, num_scheduler_steps=1) as llm:
        got["tiny_eager"] = _outputs(llm, TINY_REQUESTS)
        got["tiny_alone"] = _outputs(llm, TINY_REQUESTS[2:3])
        reseeded = dict(TINY_REQUESTS[0][1], seed=TINY_REQUESTS[0][1]["seed"] + 1)
        got["tiny_reseeded"] = _outputs(llm, [(TINY_REQUESTS[0][0], reseeded), *TINY_REQUESTS[1:]])
    with LLM(tiny, num_scheduler_steps=1) as llm:
        _static_steps(llm)
        got["tiny_static"] = _outputs(llm, TINY_REQUESTS)
    with LLM(tiny, num_scheduler_steps=5) as llm:
        got["tiny_launch5"] = _outputs(llm, TINY_REQUESTS)
    with LLM(tiny, tensor_parallel_size=2) as llm:
        got["tiny_tp2"] = _outputs(llm, TINY_REQUESTS)
    with LLM(num_scheduler_steps=1) as llm:
        got["demo_eager"] = _outputs(llm, DEMO_REQUESTS)
    with LLM(num_scheduler_steps=5) as llm:
        got["demo_launch5"] = _outputs(llm, DEMO_REQUESTS)
    return got


def run_portably(out: str) -> dict:
    """_run_all in a child process under PORTABLE_KERNELS (ATen reads its capability once, at
    start), on a tiny checkpoint made there; its outputs are also written to `out`."""
    env = dict(os.environ, **PORTABLE_KERNELS)
    subprocess.run([sys.executable, os.path.abspath(__file__), "--run", out], env=env, check=True, timeout=600)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    return run_portably(str(tmp_path_factory.mktemp("recorded") / "outputs.json"))


@pytest.fixture(scope="module")
def recording() -> dict:
    with open(RECORDING) as f:
        return json.load(f)


def test_the_outputs_ran_on_the_portable_kernels(runs):
    assert runs["kernels"] == {"cpu_capability": "AVX2", "threads": 1}


@pytest.mark.parametrize("name", RECORDED)
def test_seeded_outputs_equal_the_recording(runs, recording, name):
    assert runs[name] == recording[name]


def test_a_changed_seeded_output_fails_the_comparison(runs, recording):
    """The comparison sees a change of one request's output: the first request reseeded gives other
    tokens, and the others stay as recorded."""
    changed = runs["tiny_reseeded"]
    assert changed != recording["tiny_eager"]
    assert changed[0]["token_ids"] != recording["tiny_eager"][0]["token_ids"]
    assert changed[1:] == recording["tiny_eager"][1:]


def test_several_steps_per_launch_give_the_recording(runs, recording):
    """Five steps back to back per launch, through the static step: the tokens,
    logprobs and step counts of one step at a time."""
    assert runs["tiny_launch5"] == recording["tiny_eager"]
    assert runs["demo_launch5"] == recording["demo_eager"]


def test_the_recording_exercises_the_sampler(runs):
    """The recorded requests reach what they are meant to: several canvases, stops before the
    last step, and (alone or in a batch) the same tokens."""
    eager = runs["tiny_eager"]
    assert all(o["canvases"] >= 2 for o in eager)
    assert runs["tiny_static"] == eager
    assert runs["tiny_alone"][0] == eager[2]
    demo = runs["demo_eager"][0]  # the trained model converges: canvases stop early
    assert demo["canvases"] >= 2 and demo["denoising_steps"] < demo["canvases"] * DEMO_REQUESTS[0][1]["max_denoising_steps"]


def _child(out: str) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        got = _run_all(make_tiny_model(os.path.join(d, "tiny"), TinySpec(**TINY)))
    got["kernels"] = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    with open(out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        _child(sys.argv[2])
    else:  # record
        with tempfile.TemporaryDirectory() as d:
            got = run_portably(os.path.join(d, "outputs.json"))
        os.makedirs(os.path.dirname(RECORDING), exist_ok=True)
        with open(RECORDING, "w") as f:
            json.dump({name: got[name] for name in RECORDED}, f)
        print(f"wrote {RECORDING}", file=sys.stderr)
