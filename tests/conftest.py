"""Shared fixtures: tiny random checkpoints built once per session."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton kernels (blockdiff/ops) run under Triton's interpreter where there is no GPU, so their
# tests check them on the CPU. Triton reads the variable when a kernel is decorated: before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from blockdiff.model.tiny import TinySpec, make_tiny_model
from blockdiff.parallel.ranks import RankProcesses

# One intra-op thread, as the engine itself picks for models this small (blockdiff/engine/startup.py): on a
# shared 2-core machine two threads made each tiny op wait for both to be scheduled, and tests
# that run the model directly took 10 to 25 times longer.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true",
                     help="the long forms of the soak and fault tests (schemathesis with 200 examples per operation)")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """make(name, **spec) -> path of a tiny checkpoint, built once per session and name."""
    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, str] = {}

    def make(name: str = "default", **spec) -> str:
        if name not in made:
            made[name] = make_tiny_model(str(root / name), TinySpec(**spec))
        return made[name]

    return make


@pytest.fixture(scope="session")
def tiny(checkpoints) -> str:
    """The default tiny checkpoint: odd vocabulary, GQA, sliding/full layers of different head dims."""
    return checkpoints("default", vocab_size=301, canvas_length=8, sliding_window=6, seed=1)


@pytest.fixture(scope="session", params=[2, 3], ids=["tp2", "tp3"])
def tp_ranks(request):
    """A real tensor-parallel group of CPU processes (gloo): this process is rank 0."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # see single_threaded_workers
        ranks = RankProcesses(request.param, "cpu")
    with ranks:
        yield ranks


@pytest.fixture
def single_threaded_workers(monkeypatch):
    """Processes started by the test run one intra-op thread each. Several ranks on a 2-core
    machine otherwise each split every op over both cores, and each op waits for all its threads
    to be scheduled: steps took ten times longer on a busy machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
