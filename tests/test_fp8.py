"""FP8 checkpoints (compressed-tensors float-quantized): made by `blockdiff quantize`, loaded,
run against transformers + compressed-tensors, split over ranks, and refused when malformed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from fp8_oracle import load_fp8_oracle
from helpers import Harness, rel_err
from safetensors.torch import load_file, save_file
from test_parity import Oracle, _tokens

from blockdiff.entrypoints.cli import main as cli
from blockdiff.model.loader import load_model

VOCAB = 301
# FP8 rounds the same values the same way in both; what is left is float32 summation order, as in
# the float32 parity tests (FP8 itself moves these logits by ~0.67 of the largest).
FP8_TOL = 1e-4


@pytest.fixture(scope="module")
def src(checkpoints) -> str:
    return checkpoints("fp8_src", vocab_size=VOCAB, canvas_length=8, sliding_window=6, seed=5)


@pytest.fixture(scope="module")
def fp8(src, tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("fp8") / "model")
    assert cli(["quantize", "--fp8-dynamic", src, dst]) == 0
    return dst


def _logits(ours_or_ref, prompt, canvas):
    ours_or_ref.encode(prompt)
    return ours_or_ref.decode(canvas)


def test_parity_with_transformers_compressed_tensors(fp8, src):
    prompt, canvas = _tokens(13, VOCAB, 0), _tokens(8, VOCAB, 1)
    ours = _logits(Harness(load_model(fp8)), prompt, canvas)
    ref = _logits(Oracle(load_fp8_oracle(fp8)), prompt, canvas)
    full = _logits(Harness(load_model(src)), prompt, canvas)
    err, fp8_err = rel_err(ours, ref), rel_err(ref, full)
    print(f"ours vs oracle {err:.2e}; oracle vs float32 model {fp8_err:.2e}")
    assert err <= FP8_TOL
    assert fp8_err > 10 * FP8_TOL  # the tolerance is far below what FP8 itself changes
