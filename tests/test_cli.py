"""The command line, run as a user runs it: a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys


def _blockdiff(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockdiff", *args], capture_output=True, text=True, timeout=timeout)


def test_make_tiny_model_then_generate(tmp_path):
    path = str(tmp_path / "tiny")
    made = _blockdiff("make-tiny-model", path, "--vocab-size", "211", "--canvas-length", "8", "--num-layers", "2")
    assert made.returncode == 0, made.stderr
    out = _blockdiff(
        "generate", "--model", path, "--max-tokens", "12", "--max-denoising-steps", "3",
        "--seed-per-request", "7", "--ignore-eos", "--json", "hello world", "the quick brown fox",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["hello world", "the quick brown fox"]
    for r in rows:
        assert len(r["token_ids"]) == 12 and r["finish_reason"] == "length" and isinstance(r["text"], str)
        assert r["metrics"]["canvases"] == 2 and r["metrics"]["denoising_steps"] <= 6
    plain = _blockdiff("generate", "--model", path, "--max-tokens", "12", "--max-denoising-steps", "3",
                       "--seed-per-request", "7", "--ignore-eos", "hello world")
    assert plain.stdout.strip() == rows[0]["text"].strip()


def test_generate_rejects_bad_flags_with_a_clear_error(tmp_path):
    path = str(tmp_path / "tiny")
    assert _blockdiff("make-tiny-model", path, "--vocab-size", "211", "--num-layers", "2").returncode == 0
    bad = _blockdiff("generate", "--model", path, "--entropy-bound", "-1", "hi")
    assert bad.returncode == 2 and "entropy_bound" in bad.stderr
    missing = _blockdiff("generate", "--model", str(tmp_path / "nope"), "hi")
    assert missing.returncode == 2 and "not a checkpoint directory" in missing.stderr
