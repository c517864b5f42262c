"""The command line, run as a user runs it: a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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


def test_count_flags_below_their_minimum_are_refused_by_name(capsys):
    from blockdiff.entrypoints.cli import build_parser

    parser = build_parser()
    for argv, flag, minimum in [
        (["bench", "offline", "--num-iters", "0"], "--num-iters", 1),
        (["bench", "offline", "--num-warmup", "-1"], "--num-warmup", 0),
        (["bench", "serve", "--num-prompts", "0"], "--num-prompts", 1),
        (["bench", "serve", "--max-concurrency", "-3"], "--max-concurrency", 1),
        (["train-demo", "--steps", "0"], "--steps", 1),
        (["serve", "--max-queued-requests", "-1"], "--max-queued-requests", 0),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(argv)
        assert exit_info.value.code == 2
        assert f"argument {flag}: must be >= {minimum}" in capsys.readouterr().err
    done = _blockdiff("bench", "offline", "--num-iters", "0", timeout=60)
    assert done.returncode == 2 and "argument --num-iters: must be >= 1, got 0" in done.stderr, done.stderr
