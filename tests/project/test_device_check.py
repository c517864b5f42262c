"""scripts/device_check.sh --device cpu --small: the device check's every part on tiny shapes, so
that the script the GPU runs cannot rot (docs/device_check.md), and what it brings back when a part
fails, hangs or does not fit the budget."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = ["env", "headline", "fp8", "kernels", "steps_per_launch", "transformers", "tests", "compiled", "fake_cuda"]


def _start(out, *args, **env) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.txt", "w") as stdout, open(out / "stderr.txt", "w") as stderr:
        return subprocess.Popen(["bash", "scripts/device_check.sh", "--device", "cpu", "--small", "--out", str(out), *args],
                                cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)


def _finish(proc: subprocess.Popen, out, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text())
    return done, json.loads((out / "device_check.json").read_text())


def _check(out, *args, **env) -> tuple[subprocess.CompletedProcess, dict]:
    return _finish(_start(out, *args, **env), out)


@pytest.fixture(scope="module")
def failing_check(tmp_path_factory):
    """The check of test_a_failing_or_hanging_part_leaves_every_other_result, started by the
    module's first test: its hanging part sleeps through its 45 s time-out, so it runs alongside
    the full check instead of after it. Yields a function: -> (process, report), once it has ended."""
    out = tmp_path_factory.mktemp("failing_check")
    proc = _start(out, "--parts", "env,headline,fp8", "--fail-part", "env", "--hang-part", "headline",
                  "--timeout-s", "45")  # fp8's small shapes took over 15 s on a loaded 2-core machine
    try:
        yield lambda: _finish(proc, out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _parts(report: dict) -> dict:
    return {p["name"]: p for p in report["parts"]}


# What the GPU machine lacks (the library's device notes): the check and its CUDA test selections
# must run without them.
MISSING_ON_THE_GPU = ("compressed_tensors", "fastapi", "pydantic", "zmq", "outlines_core", "openai")


def _without_the_gpus_missing_packages(root) -> str:
    """A folder to put first on PYTHONPATH in which importing each of them fails as on the GPU machine."""
    for name in MISSING_ON_THE_GPU:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f'raise ImportError("the GPU machine has no {name}")\n')
    return str(root)


@pytest.mark.slow  # every part of the script at small shapes: ~2 min on 2 cores
def test_the_device_check_runs_every_part_on_the_cpu_at_small_shapes(tmp_path, failing_check):
    """Every part, in the script's order, without the packages the GPU machine lacks; the tests
    part collects the CUDA test selections under the same blocks, so a CUDA-only test that imports
    one of them fails here. (It asks for failing_check only to start that check first: both run at once.)"""
    proc, report = _check(tmp_path / "out", PYTHONPATH=_without_the_gpus_missing_packages(tmp_path / "blocked"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p["name"] for p in report["parts"]] == PARTS and all(p["status"] == "ok" for p in report["parts"]), report
    parts = _parts(report)
    env = parts["env"]["result"]
    # bfloat16 experts follow the CPU: batched products where it has AMX, grouped ones elsewhere.
    flags = {w for line in open("/proc/cpuinfo") if line.startswith("flags") for w in line.split()}
    assert env["versions"]["torch"] and env["kernels"]["bfloat16"]["experts"] == ("batched" if "amx_bf16" in flags else "grouped")
    assert env["kernels"]["fp8"]["experts"] == "per_expert" and env["sdpa_backends"]
    for name, batches in (("headline", {"1", "2"}), ("fp8", {"1", "2"})):
        measured = parts[name]["result"]["batches"]
        assert set(measured) == batches
        for m in measured.values():
            assert m["two_canvases_s"] > m["one_canvas_s"] > 0 and m["ms_per_step"] > 0
            assert m["bound_ms"] == max(m["memory_ms"], m["compute_ms"]) > 0 and m["bound_limit"] in ("bytes", "FLOPs")
            assert set(m["steps_per_canvas"]) == {2}  # no early stop: every canvas took every step
    kernels = parts["kernels"]["result"]
    assert len(kernels["attention"]) == 2 * 2 * 2 and len(kernels["sampler"]) == 2  # kinds x contexts x batches
    for m in [*kernels["attention"].values(), *kernels["sampler"].values()]:
        assert m["triton_ms"] > 0 and m["reference_ms"] > 0 and m["bound_ms"] > 0 and m["bytes"] > 0 and m["flops"] > 0
    assert parts["transformers"]["result"]["version"] and parts["transformers"]["result"]["ms_per_step"] > 0
    for name, t in parts["tests"]["result"]["selections"].items():
        assert t["passed"] and int(re.search(r"(\d+)(/\d+)? tests? collected", t["summary"]).group(1)) > 0, name
    # Timings, not their sizes: at these shapes on a shared CPU a canvas's difference is noise.
    compiled = parts["compiled"]["result"]
    assert all(math.isfinite(compiled[k]) for k in ("compile_s", "speedup", "eager_ms_per_step", "compiled_ms_per_step"))
    fake_cuda = parts["fake_cuda"]["result"]["selections"]["fake CUDA and kernel choice"]
    assert fake_cuda["passed"] and int(re.search(r"(\d+) tests? collected", fake_cuda["summary"]).group(1)) > 0
    text = (tmp_path / "out" / "device_check.txt").read_text()
    assert proc.stdout.endswith(text) and "ms/step" in text and "fake_cuda: ok" in text


@pytest.mark.slow  # the whole script with one part failing and one hanging: ~1 min on 2 cores
def test_a_failing_or_hanging_part_leaves_every_other_result(failing_check):
    """--fail-part makes env raise: it is recorded with its traceback's tail. --hang-part makes the
    headline hang after its first result: at its time-out it is killed (with its children) and
    recorded as timed out, with what it measured. The part after them still runs and keeps its
    results, and the check exits non-zero."""
    proc, report = failing_check()
    assert proc.returncode == 1
    env, headline, fp8 = report["parts"]
    assert [p["status"] for p in report["parts"]] == ["failed", "failed", "ok"]
    assert env["error"] == "exit status 1" and "failure injected into part 'env'" in env["traceback"][-1]
    assert headline["error"] == "timed out after 45 s" and headline["seconds"] < 55
    assert headline["result"]["peaks"]["measured_copy_gbs"] > 0  # recorded before the hang
    assert set(fp8["result"]["batches"]) == {"1", "2"}
    assert "env: failed" in proc.stdout and "headline: failed" in proc.stdout


def test_what_does_not_fit_the_budget_is_skipped_and_says_so(tmp_path):
    """Also: a wheel that does not install (carried broken) is reported, and the check runs on."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "notapackage-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    proc, report = _check(tmp_path / "out", "--parts", "env,compiled", "--budget-s", "30", DEVICE_WHEELS=str(wheels))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "could not install" in proc.stderr and "notapackage-1.0-py3-none-any.whl" in proc.stderr
    env, compiled = report["parts"]
    assert env["status"] == "ok" and compiled["status"] == "skipped"
    assert re.fullmatch(r"needs about 60 s, \d+ s of the budget left", compiled["reason"])


def test_the_summary_shows_what_a_part_recorded_before_it_failed():
    """env records the GPU before it asks blockdiff/ops/kernels.py for its choices: a failure between
    the two leaves `gpu` without `kernels`, and the summary still prints."""
    spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "scripts", "device_check.py"))
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    data = {"device": "cuda", "small": False, "budget_s": 420, "seconds": 12.0,
            "parts": [{"name": "env", "status": "failed", "seconds": 3.0, "error": "exit status 1", "traceback": ["KeyError"],
                       "result": {"versions": {"torch": "2.11.0"}, "gpu": "NVIDIA H200"}}]}
    text = check.summary(data)
    assert "NVIDIA H200, torch 2.11.0" in text and "env: failed" in text
