"""The command line, run as a user runs it: a subprocess."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import sys

import pytest


def _blockdiff(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockdiff", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # two CLI processes, one of them generating: 16 s on a quiet 2-core AVX2 machine
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
    for r in rows:  # vLLM's shape: the completion in outputs[0]
        c = r["outputs"][0]
        assert len(c["token_ids"]) == 12 and c["finish_reason"] == "length" and isinstance(c["text"], str)
        assert r["metrics"]["canvases"] == 2 and r["metrics"]["denoising_steps"] <= 6
    plain = _blockdiff("generate", "--model", path, "--max-tokens", "12", "--max-denoising-steps", "3",
                       "--seed-per-request", "7", "--ignore-eos", "hello world")
    assert plain.stdout.strip() == rows[0]["outputs"][0]["text"].strip()


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


def test_vllm_spellings_and_help_with_defaults(capsys):
    from blockdiff import __version__
    from blockdiff.demo import CHECKPOINT_DIR
    from blockdiff.entrypoints.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for expected in ["--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE processes the model is split over",
                     "(default: 1)", "(default: auto)", "(default: 8000)", "(default: 127.0.0.1)", "(default: 0)",
                     "--max-num-batched-tokens MAX_PREFILL_TOKENS, --max-prefill-tokens MAX_PREFILL_TOKENS",
                     "--gpu-memory-utilization", "refused: pipeline parallelism is not implemented"]:
        assert expected in text, expected
    assert "(default: None)" not in text
    with pytest.raises(SystemExit) as version:
        parser.parse_args(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out.strip() == f"blockdiff {__version__}"
    args = parser.parse_args(["serve", "--model", "m", "--max-num-batched-tokens", "64", "--log-level", "DEBUG"])
    assert (args.model, args.model_tag, args.max_prefill_tokens, args.log_level) == ("m", None, 64, "debug")
    assert parser.parse_args(["--log-level", "warning", "serve"]).log_level == "warning"  # the global one is kept
    assert parser.parse_args(["serve", "--uvicorn-log-level", "WARNING"]).uvicorn_log_level == "warning"
    assert os.path.abspath(parser.parse_args(["train-demo"]).out) != CHECKPOINT_DIR  # an experiment never replaces it


def test_serve_help_starts_with_the_model_and_the_main_flags():
    """`blockdiff serve --help | head -30` shows what a first run sets, as vLLM's help does: a short
    usage line, MODEL, then the main flags; every flag is still listed further down."""
    from blockdiff.entrypoints.cli import build_parser

    done = subprocess.run([sys.executable, "-m", "blockdiff", "serve", "--help"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "usage: blockdiff serve [MODEL] [options]"
    head = "\n".join(lines[:30])
    for name in ["MODEL", "--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--dtype",
                 "--tensor-parallel-size", "--max-num-seqs"]:
        assert re.search(rf"^  {name} ", head, re.M), f"{name} not in the first 30 lines:\n{head}"
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {name for a in commands.choices["serve"]._actions for name in a.option_strings}
    listed = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", done.stdout))
    assert len(flags) > 100 and flags <= listed, sorted(flags - listed)


@pytest.mark.slow  # several CLI processes: ~12 s on 2 cores
def test_tokenizer_chat_template_and_ignored_vllm_flags(tmp_path):
    """--tokenizer gives a tokenizer-less checkpoint one; --chat-template replaces the template (the
    prompt token count shows which was used); an ignored vLLM flag warns and changes nothing."""
    from blockdiff.model.tiny import TinySpec, make_tiny_model

    bare = make_tiny_model(str(tmp_path / "bare"), TinySpec(num_layers=1, vocab_size=211, tokenizer=False))
    full = make_tiny_model(str(tmp_path / "full"), TinySpec(num_layers=1, vocab_size=211))
    common = ["generate", "--model", bare, "--tokenizer", full, "--max-tokens", "8", "--json", "--chat", "hello"]
    plain = _blockdiff(*common, "--chat-template", "{{ messages[0]['content'] }}", "--gpu-memory-utilization", "0.9")
    assert plain.returncode == 0, plain.stderr
    assert "--gpu-memory-utilization is ignored: the KV cache is sized by --kv-cache-memory" in plain.stderr
    templated = _blockdiff(*common)
    assert templated.returncode == 0, templated.stderr
    from blockdiff.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(full)
    assert json.loads(plain.stdout)["prompt_token_ids"] == tok.encode("hello", add_special_tokens=False)
    assert json.loads(templated.stdout)["prompt_token_ids"] == tok.encode_chat([{"role": "user", "content": "hello"}])


def test_checkpoint_files_get_the_umask_mode(tmp_path):
    from blockdiff.model.tiny import TinySpec, make_tiny_model

    old = os.umask(0o022)
    try:
        path = make_tiny_model(str(tmp_path / "m"), TinySpec(num_layers=1, vocab_size=64))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(os.path.join(path, "model.safetensors")).st_mode) == 0o644


@pytest.mark.slow  # a training run: 13 s on a quiet 2-core AVX2 machine
def test_train_demo_tasks_flag(tmp_path):
    """--tasks reaches the training record, a repeated name weights its task, an unknown one is an error."""
    out = tmp_path / "ckpt"
    done = _blockdiff("train-demo", "--steps", "1", "--batch-size", "2", "--tasks", "think,think,sort", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "blockdiff_demo.json").read_text())["train_config"]["tasks"] == ["think", "think", "sort"]
    bad = _blockdiff("train-demo", "--steps", "1", "--tasks", "sort,nope", "--out", str(out), timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("error: --tasks: unknown task(s) nope; the tasks are sort, ")


def _all_parsers(parser):
    import argparse

    stack, seen = [parser], []
    while stack:
        p = stack.pop()
        seen.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += action.choices.values()
    return seen


def test_no_parser_takes_a_prefix_of_a_flag():
    """`--max-num-seq 4` must not silently mean `--max-num-seqs 4`: every command's parser wants long
    flags spelled out, and an abbreviation is refused."""
    from blockdiff.entrypoints.cli import build_parser

    parser = build_parser()
    parsers = _all_parsers(parser)
    assert len(parsers) > 10  # blockdiff, its commands, bench's
    assert [p.prog for p in parsers if p.allow_abbrev] == []
    for argv in (["serve", "--max-num-seq", "4"], ["bench", "serve", "--num-prompt", "4"], ["generate", "--max-tok", "4", "x"]):
        with pytest.raises(SystemExit) as refused:
            parser.parse_args(argv)
        assert refused.value.code == 2


def test_make_tiny_model_does_not_overwrite_a_checkpoint_unless_asked(tmp_path, capsys):
    from blockdiff.entrypoints.cli import main

    path = str(tmp_path / "tiny")
    small = ["make-tiny-model", path, "--vocab-size", "64", "--num-layers", "1"]
    assert main([*small, "--seed", "1"]) == 0
    weights = tmp_path / "tiny" / "model.safetensors"
    first = weights.read_bytes()
    assert main([*small, "--seed", "2"]) == 2
    assert f"error: {path} holds a checkpoint; pass --overwrite" in capsys.readouterr().err
    assert weights.read_bytes() == first
    assert main([*small, "--seed", "2", "--overwrite"]) == 0 and weights.read_bytes() != first
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["make-tiny-model", str(tmp_path / "other"), "--vocab-size", "64", "--num-layers", "1"]) == 2
    assert "is not empty; pass --overwrite" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["make-tiny-model", str(tmp_path / "empty"), "--vocab-size", "64", "--num-layers", "1"]) == 0


def test_generate_progress_moves_with_each_committed_canvas(tmp_path):
    """Two requests of 8 canvases each end together: the bar must show tokens being committed while
    it still reads 0/2 (tqdm set to redraw at every update, so each draw can be seen)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0"}
    done = subprocess.run([sys.executable, "-m", "blockdiff", "generate", "--chat", "--max-tokens", "64", "--ignore-eos",
                           "--max-denoising-steps", "2", "sort: 3 1 2", "sort: 2 1 3"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    draws = [d for d in done.stderr.replace("\r", "\n").splitlines() if d.startswith("Generating")]
    moving = [int(m.group(1)) for d in draws if " 0/2 " in d and (m := re.search(r"(\d+) tokens committed", d))]
    assert len(set(moving)) >= 3 and max(moving) < 128, draws


def test_setup_script_says_what_each_stage_does(tmp_path):
    """scripts/setup.sh, run in a copy of the repository with a stand-in `python3` (whose venv's
    python records its arguments instead of installing): a line names each stage before it runs."""
    import shutil

    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "setup.sh"), root / "scripts" / "setup.sh")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\n# python3 -m venv DIR: a venv whose python echoes what it was asked\n'
                                  'mkdir -p "$3/bin"\nprintf \'#!/bin/sh\\necho "ran python $*"\\n\' > "$3/bin/python"\n'
                                  'chmod +x "$3/bin/python"\n')
    (fake / "python3").chmod(0o755)
    done = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # venv, pip, torch, blockdiff, the CPU kernels: each said before it runs; then done
    assert ["said" if ln.startswith("setup.sh [") else ln.split(" -q ")[-1] for ln in lines] == [
        "said", "said", "--upgrade pip", "said", "torch==2.13.0", "said", "-c scripts/constraints.txt -e .[test]", "said",
        "ran python -c from blockdiff.ops import cpu_grouped; cpu_grouped.extension()", "said"], lines
    assert "torch" in lines[3] and "test extra" in lines[5] and "kernels" in lines[7] and "done" in lines[9]


def test_engine_flags_are_the_engine_config_fields():
    """Every EngineConfig field with a Flag is a flag whose default is the field's, and what a flag
    reads lands in its field: the fields are spelled once."""
    import argparse
    import dataclasses

    from blockdiff.arg_utils import add_engine_args, engine_config
    from blockdiff.config import EngineConfig
    from blockdiff.hub import demo_checkpoint

    p = argparse.ArgumentParser()
    add_engine_args(p)
    flagged = [f.name for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata]
    assert {"tensor_parallel_size", "max_prefill_tokens", "compile", "allowed_media_domains"} <= set(flagged)
    assert dataclasses.replace(engine_config(p.parse_args([])), tune_cpu_heap=False) == EngineConfig(demo_checkpoint())
    cfg = engine_config(p.parse_args([
        "-tp", "2", "--max-num-batched-tokens", "64", "--kv-cache-memory", "1MiB", "--no-preemption",
        "--no-enable-prefix-caching", "--compile", "--allowed-media-domains", "a.org", "b.org", "--worker-timeout", "5",
        "--limit-mm-per-prompt", '{"image": 2}', "--dtype", "bfloat16", "--sampler-memory-gb", "0.5",
    ]))
    assert (cfg.tensor_parallel_size, cfg.max_prefill_tokens, cfg.kv_cache_memory, cfg.preempt_after_canvases) == (2, 64, 2**20, None)
    assert (cfg.enable_prefix_caching, cfg.compile, cfg.allowed_media_domains, cfg.worker_timeout) == (False, True, ("a.org", "b.org"), 5.0)
    assert (cfg.limit_images_per_prompt, cfg.dtype, cfg.sampler_memory_gb) == (2, "bfloat16", 0.5)
