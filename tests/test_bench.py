"""Benchmarks as smoke tests (no timing is asserted): `bench offline`, with and without transformers
beside it, the roofline's counting, and `bench serve` against a real `blockdiff serve` process."""

from __future__ import annotations

import json
import os

import pytest
import torch

from blockdiff.bench.offline import parse_batch_sizes
from blockdiff.bench.roofline import _keys_seen, bound, parameter_count, plan_cost
from blockdiff.config import ModelConfig
from blockdiff.diffusion.sampler import denoise_params
from blockdiff.sampling_params import REFERENCE_DEFAULTS, SamplingParams
from blockdiff.step import StepPlan
from blockdiff.entrypoints.cli import main
from blockdiff.model.attention import Row

CANVAS = 8  # the `tiny` checkpoint's canvas length
BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "diffusiongemma-26b-a4b.json")


def _offline(tiny, tmp_path, capsys, *extra):
    out = tmp_path / "offline.json"
    argv = ["bench", "offline", "--model", tiny, "--batch-sizes", "1,2", "--input-len", "5", "--output-len", "16",
            "--denoising-steps", "2", "--num-iters", "1", "--num-warmup", "0", "--output-json", str(out), *extra]
    assert main(argv) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_bench_offline(tiny, tmp_path, capsys):
    printed, saved = _offline(tiny, tmp_path, capsys)
    assert "Offline Benchmark" in printed and "Roofline" in printed and "transformers" not in printed
    assert saved["config"]["denoising_steps"] == 2 and saved["config"]["peak_gflops"] > 0
    assert [r["batch"] for r in saved["results"]] == [1, 2]
    for row in saved["results"]:
        assert row["blockdiff_s"] > 0 and "speedup" not in row
        assert row["blockdiff_tok_s"] == pytest.approx(row["batch"] * 16 / row["blockdiff_s"])
        phases = row["phases"]
        # 16 tokens = 2 canvases of 8, 2 steps each; requests run in lockstep: one prefill step,
        # 4 denoising steps, one commit (the last canvas is never committed)
        assert {k: v["steps"] for k, v in phases.items()} == {"prefill": 1, "denoise": 4, "commit": 1}
        assert all(v["gflop_per_step"] > 0 and v["mb_per_step"] > 0 for v in phases.values())
    one, two = (r["phases"]["denoise"]["gflop_per_step"] for r in saved["results"])
    assert two == pytest.approx(2 * one)  # same work per canvas, twice the canvases


def test_bench_offline_against_transformers(tiny, tmp_path, capsys):
    printed, saved = _offline(tiny, tmp_path, capsys, "--compare", "transformers")
    assert "alternating with transformers" in printed and "speedup" in printed
    for row in saved["results"]:
        assert row["transformers_s"] > 0
        assert row["speedup"] == pytest.approx(row["transformers_s"] / row["blockdiff_s"])
        assert f"{row['speedup']:.2f}x" in printed


@pytest.mark.parametrize("text", ["", "1,x", "0,2", "-1"])
def test_bench_offline_rejects_bad_batch_sizes(text):
    with pytest.raises(ValueError, match="batch-sizes"):
        parse_batch_sizes(text)


def test_keys_seen_by_hand():
    # decoder canvas of 4 after 10 cached tokens: every query sees the cache and the whole canvas
    assert _keys_seen(10, 4, decoder=True, window=None) == 4 * 14
    # ... on a sliding layer of window 6 it sees the last 5 cached tokens
    assert _keys_seen(10, 4, decoder=True, window=6) == 4 * 9
    # causal chunk of 4 after 3 cached: queries see 4, 5, 6, 7 keys; with window 5: 4, 5, 5, 5
    assert _keys_seen(3, 4, decoder=False, window=None) == 22
    assert _keys_seen(3, 4, decoder=False, window=5) == 19


def test_parameter_count_matches_the_model(checkpoints, tiny):
    """The roofline's weight accounting, against the model the loader builds (two layer layouts)."""
    from blockdiff.model.loader import load_model

    other = checkpoints("bench-dense", vocab_size=263, num_layers=3, num_experts=6, top_k_experts=2, seed=2)
    for path in (tiny, other):
        model = load_model(path)
        text = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("vision."))
        assert parameter_count(ModelConfig.from_pretrained(path)) == text


def test_roofline_counts_per_canvas_work_once_per_canvas(tiny):
    config = ModelConfig.from_pretrained(tiny)

    def plan(rows: int, step: int) -> StepPlan:
        denoise = denoise_params([step] * rows, [SamplingParams().with_defaults({**REFERENCE_DEFAULTS, "max_denoising_steps": 4})] * rows,
                                 uniform=torch.zeros(rows, CANVAS), renoise=torch.zeros(rows, CANVAS, dtype=torch.long))
        return StepPlan([Row(i, 12, CANVAS, True, (0,)) for i in range(rows)], torch.empty(0), [], torch.empty(0), denoise)

    one, three = plan_cost(config, plan(1, 2), 4), plan_cost(config, plan(3, 2), 4)
    assert three.flops == pytest.approx(3 * one.flops)
    assert one.bytes < three.bytes < 3 * one.bytes  # the weights are read once per step, not per canvas
    # the last step of a canvas skips the soft-embedding product: vocabulary x hidden MACs per token
    last = plan_cost(config, plan(1, 1), 4)
    assert one.flops - last.flops == pytest.approx(2 * CANVAS * config.vocab_size * config.hidden_size)


def test_the_26b_step_is_memory_bound_alone_and_compute_bound_at_batch_16():
    """The bound is the larger of bytes / bandwidth and FLOPs / matmul rate: at one H200's 4.8 TB/s
    and 790 TFLOP/s the 26B-A4B step of one canvas is weight-bound (~50 GB: ~10.5 ms), of 16
    canvases compute-bound (~37 TFLOP: 45-50 ms), where the bytes alone (weights, and 16 canvases of
    float32 logits) would say ~14 ms."""
    config = ModelConfig.from_pretrained(BIG)
    cl = config.canvas_length

    def cost(rows: int, weight_bytes: float | None = None):
        denoise = denoise_params([8] * rows, [SamplingParams().with_defaults(REFERENCE_DEFAULTS)] * rows,
                                 uniform=torch.zeros(rows, cl), renoise=torch.zeros(rows, cl, dtype=torch.long))
        plan = StepPlan([Row(i, 128 + cl, cl, True) for i in range(rows)], torch.empty(0), [], torch.empty(0), denoise)
        return plan_cost(config, plan, 2, weight_bytes)

    one, sixteen = bound(cost(1), 4800, 790e3), bound(cost(16), 4800, 790e3)
    assert one.limit == "memory" and 9.5e-3 < one.seconds < 11.5e-3, one
    assert sixteen.limit == "compute" and 44e-3 < sixteen.seconds < 50e-3 and sixteen.memory_s < sixteen.seconds / 3, sixteen
    fp8 = bound(cost(1, weight_bytes=1), 4800, 2 * 790e3)
    assert fp8.limit == "memory" and 5e-3 < fp8.seconds < 6.5e-3, fp8  # the LM head and KV cache stay bfloat16


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    from server_process import ServerProcess

    proc = ServerProcess(tiny, "--max-num-seqs", "4", log_path=str(tmp_path_factory.mktemp("bench") / "server.log"))
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def serve_run(server, tiny, tmp_path_factory):
    """One `bench serve` run against the real server: (printed report, saved JSON path)."""
    import contextlib
    import io

    result = tmp_path_factory.mktemp("serve") / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url, "--model", tiny, "--dataset-name", "random",
            "--random-input-len", "6", "--random-output-len", "16", "--num-prompts", "6", "--max-concurrency", "3",
            "--ignore-eos", "--seed", "1", "--disable-tqdm", "--save-result", "--result-filename", str(result),
            "--extra-body", json.dumps({"max_denoising_steps": 3, "stability_threshold": 3})]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return printed.getvalue(), result


def test_bench_serve(serve_run):
    printed, result = serve_run
    # Only the report counts: some labels are also printed before the run.
    _, report = printed.split("=" * 12 + " Serving Benchmark Result " + "=" * 12)
    for label in ("Successful requests:", "Failed requests:", "Maximum request concurrency:",
                  "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
                  "Time to First Token", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "Time per Output Token (excl. 1st token)", "Mean TPOT (ms):", "Inter-token Latency", "Mean ITL (ms):",
                  "End-to-end Latency", "P99 E2EL (ms):", "Diffusion Decoding", "Committed throughput (tok/s):",
                  "Denoising steps per canvas:", "Committed tokens per denoising step:", "Committed tokens:",
                  "Denoising steps:", "Canvas positions evaluated:"):
        assert label in report, label
    saved = json.loads(result.read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0
    assert saved["total_input_tokens"] == 6 * 6 and saved["total_output_tokens"] == 6 * 16
    assert saved["output_lens"] == [16] * 6 and all(len(itl) == 1 for itl in saved["itls"])  # 2 canvases, 2 chunks
    d = saved["diffusion"]
    # ignore_eos and a stability threshold no canvas reaches: 2 canvases per request, 3 steps each
    assert d["canvases"] == 12 and d["denoising_steps"] == 36 and d["denoising_steps_per_canvas"] == 3
    assert d["canvas_positions_evaluated"] == 36 * CANVAS and d["committed_tokens"] == 96
    assert saved["mean_ttft_ms"] > 0 and saved["p99_e2el_ms"] >= saved["median_e2el_ms"] > 0


def test_bench_plot(serve_run, tmp_path):
    png = tmp_path / "latency.png"
    assert main(["bench", "plot", str(serve_run[1]), "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _serve_args(*argv: str):
    import argparse

    from blockdiff.bench.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--dataset-name", "prefix-repetition", "--num-prompts", "6", "--prefix-repetition-prefix-len",
                         "10", "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
                         "--prefix-repetition-output-len", "24", *argv])


def test_prefix_repetition_prompts_share_prefixes_and_not_suffixes(tiny):
    from blockdiff.bench.datasets import special_token_ids
    from blockdiff.bench.serve import make_prompts, output_len

    args = _serve_args("--model", tiny)
    prompts, lens = make_prompts(args)
    assert lens == [14] * 6 and [len(p) for p in prompts] == lens and output_len(args) == 24
    prefixes = [tuple(p[:10]) for p in prompts]
    assert prefixes[0] != prefixes[1] and prefixes == [prefixes[0], prefixes[1]] * 3
    assert len({tuple(p[10:]) for p in prompts}) == 6
    special = special_token_ids(ModelConfig.from_pretrained(tiny))
    assert not special & {t for p in prompts for t in p}
    # Without a checkpoint to draw token ids from, prompts are words, shared and unique the same way.
    words = [p.split() for p in make_prompts(_serve_args())[0]]
    assert [len(w) for w in words] == [14] * 6
    assert len({tuple(w[:10]) for w in words}) == 2 and len({tuple(w[10:]) for w in words}) == 6
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes"):
        make_prompts(_serve_args("--prefix-repetition-num-prefixes", "7"))
