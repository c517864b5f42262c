"""The byte accounting of benchmarks/fp8_memory.py on a tiny checkpoint: FP8 experts take exactly half
their bfloat16 bytes plus one float32 scale per output row, and the unquantized parts stay as they were."""

from __future__ import annotations

import importlib.util
import os

import torch

from blockdiff.entrypoints.cli import main as cli
from blockdiff.model.loader import load_model

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "fp8_memory.py")


def _bench():
    spec = importlib.util.spec_from_file_location("fp8_memory", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8_bytes_are_half_plus_scales(checkpoints, tmp_path):
    bench = _bench()
    src = checkpoints("fp8_bytes", vocab_size=301, canvas_length=8, sliding_window=6, seed=7)
    dst = str(tmp_path / "fp8")
    assert cli(["quantize", "--fp8-dynamic", src, dst]) == 0
    full, q = load_model(src, dtype=torch.bfloat16), load_model(dst, dtype=torch.bfloat16)
    a, b = bench.weight_bytes(full), bench.weight_bytes(q)
    embedding, experts, layers, rest = bench.PARTS
    assert b[embedding] == a[embedding] and b[rest] == a[rest]  # on the ignore list: unquantized
    scale_rows = sum(layer.experts.gate_up.shape[1] + layer.experts.down.shape[1] for layer in q.layers) * q.config.arch.num_experts
    assert b[experts] == a[experts] // 2 + 4 * scale_rows
    assert b[layers] < 0.6 * a[layers]
    assert bench.total_bytes(b) < bench.total_bytes(a)
    logits = bench.canvas_forward(q)()
    assert logits.shape == (8, 301) and torch.isfinite(logits).all()
