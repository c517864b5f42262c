"""The engine's thread count: one thread for models too small to split ops, torch's default for
others, and whatever the user chose (OMP_NUM_THREADS, torch.set_num_threads) always wins; the
startup summary says which and why."""

from __future__ import annotations

import logging

import pytest
import torch

from blockdiff import LLM
from blockdiff.engine.startup import _TORCH_DEFAULT_THREADS


@pytest.fixture
def threads_restored(monkeypatch):
    """A fresh process's threads (tests/conftest.py sets one), put back afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(_TORCH_DEFAULT_THREADS)
    yield
    torch.set_num_threads(before)


def _threads_line(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if r.getMessage().startswith("threads: "))


def test_thread_count_follows_the_model_size_unless_the_user_chose(checkpoints, caplog, threads_restored):
    small = checkpoints("startup-small", num_layers=1, vocab_size=64, hidden_size=64)
    large = checkpoints("startup-large", num_layers=1, vocab_size=64, hidden_size=512, intermediate_size=512)
    for model, threads, why in [
        (small, 1, "hidden size 64 is too small to split ops over threads"),
        (large, _TORCH_DEFAULT_THREADS, "torch's default, one per core"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="blockdiff"), LLM(model, device="cpu"):
            assert torch.get_num_threads() == threads
        assert _threads_line(caplog).startswith(f"threads: {threads} ({why}")
    torch.set_num_threads(3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="blockdiff"), LLM(small, device="cpu"):
        assert torch.get_num_threads() == 3
    assert _threads_line(caplog) == "threads: 3 (set by torch.set_num_threads before)"
