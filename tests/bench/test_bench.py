"""Benchmarks as smoke tests (no timing is asserted): `bench offline`, with and without transformers
beside it, the roofline's counting, and `bench serve` against a real `blockdiff serve` process."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from blockdiff.bench.offline import parse_batch_sizes
from blockdiff.bench.roofline import Cost, _keys_seen, bound, generate_costs, parameter_count, plan_cost
from blockdiff.model.registry import load_config
from blockdiff.entrypoints.cli import main
from blockdiff.model.attention import Row
from server_process import fixture_value, serve

CANVAS = 8  # the `tiny` checkpoint's canvas length
BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "diffusiongemma-26b-a4b.json")


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
        # The fraction of peak counts roofline.sequence_flops per request, what the engine's steps cost
        # to a few percent: the profile costs a launch of several steps as its first step times their
        # number (the first step's soft embedding counted for the last too, the later steps'
        # self-conditioning MLP for none).
        total = sum(v["gflop_per_step"] * v["steps"] for v in phases.values())
        assert row["blockdiff_of_peak"] == pytest.approx(total / row["blockdiff_s"] / saved["config"]["peak_gflops"], rel=0.03)
    one, two = (r["phases"]["denoise"]["gflop_per_step"] for r in saved["results"])
    assert two == pytest.approx(2 * one)  # same work per canvas, twice the canvases
    # Beside the fraction of the FLOP peak, each phase's byte-aware bound, what binds it and the
    # fraction of it reached, printed and saved.
    assert "bound ms" in printed and "of bound" in printed and "bytes of weights, KV and logits" in printed
    peak, bandwidth = saved["config"]["peak_gflops"], saved["config"]["bandwidth_gbs"]
    for row in saved["results"]:
        for p in row["phases"].values():
            # per step the longer of the two: at least the longer of the totals, at most their sum
            flops_ms, bytes_ms = p["gflop_per_step"] / peak * 1e3, p["mb_per_step"] / bandwidth
            assert max(flops_ms, bytes_ms) * (1 - 1e-9) <= p["bound_ms_per_step"] <= (flops_ms + bytes_ms) * (1 + 1e-9)
            assert p["bound_by"] == ("bytes" if bytes_ms >= flops_ms else "FLOPs")
            assert p["fraction_of_bound"] == pytest.approx(p["bound_ms_per_step"] / p["ms_per_step"])
            line = (f"{p['bound_ms_per_step']:>9.3f} {p['bound_by']:>5} {p['fraction_of_bound']:>7.1%}")
            assert line in printed


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
        assert parameter_count(load_config(path)) == text


def test_roofline_counts_per_canvas_work_once_per_canvas(tiny):
    config = load_config(tiny)

    def cost(rows: int, step: int):
        return plan_cost(config, [Row(i, 12, CANVAS, True) for i in range(rows)], [step] * rows, 0, 4)

    one, three = cost(1, 2), cost(3, 2)
    assert three.flops == pytest.approx(3 * one.flops)
    assert one.bytes < three.bytes < 3 * one.bytes  # the weights are read once per step, not per canvas
    # the last step of a canvas skips the soft-embedding product: vocabulary x hidden MACs per token
    last = cost(1, 1)
    assert one.flops - last.flops == pytest.approx(2 * CANVAS * config.vocab_size * config.hidden_size)


def test_the_26b_step_is_memory_bound_alone_and_compute_bound_at_batch_16():
    """The bound is the larger of bytes / bandwidth and FLOPs / matmul rate: at one H200's 4.8 TB/s
    and 790 TFLOP/s the 26B-A4B step of one canvas is weight-bound (~50 GB: ~10.5 ms), of 16
    canvases compute-bound (~37 TFLOP: 45-50 ms), where the bytes alone (weights, and 16 canvases of
    float32 logits) would say ~14 ms."""
    config = load_config(BIG)
    cl = config.canvas_length

    def cost(rows: int, weight_bytes: float | None = None):
        return plan_cost(config, [Row(i, 128 + cl, cl, True) for i in range(rows)], [8] * rows, 0, 2, weight_bytes)

    one, sixteen = bound(cost(1), 4800, 790e3), bound(cost(16), 4800, 790e3)
    assert one.limit == "bytes" and 9.5e-3 < one.seconds < 11.5e-3, one
    assert sixteen.limit == "FLOPs" and 44e-3 < sixteen.seconds < 50e-3 and sixteen.memory_s < sixteen.seconds / 3, sixteen
    fp8 = bound(cost(1, weight_bytes=1), 4800, 2 * 790e3)
    assert fp8.limit == "bytes" and 5e-3 < fp8.seconds < 6.5e-3, fp8  # the LM head and KV cache stay bfloat16


def test_bound_is_the_longer_of_flops_at_the_peak_and_bytes_at_the_bandwidth(tiny):
    config = load_config(tiny)
    cost = plan_cost(config, [Row(0, 12, CANVAS, True)], [2], 0, 4)
    starved = bound(cost, bandwidth_gbs=1e-6, gflops=1e6)  # a tiny bandwidth: the bytes bind
    assert starved.limit == "bytes" and starved.seconds == pytest.approx(cost.bytes / 1e3)
    slow = bound(cost, bandwidth_gbs=1e6, gflops=1e-6)  # a tiny matmul peak: the FLOPs bind
    assert slow.limit == "FLOPs" and slow.seconds == pytest.approx(cost.flops / 1e3)
    assert slow.fraction(2 * slow.seconds) == pytest.approx(0.5)
    # Over a run, each step is bound by its own resource: a byte-bound step and a FLOP-bound one
    # take 1 s each, where the totals alone would say 1 s in all.
    run = bound([Cost(flops=0, bytes=1e9), Cost(flops=1e9, bytes=0)], bandwidth_gbs=1, gflops=1)
    assert run.seconds == pytest.approx(2) and run.memory_s == pytest.approx(1) and run.compute_s == pytest.approx(1)


def test_step_bytes_count_the_logits_and_the_kv_read(tiny):
    """The bytes of a denoising step grow by the float32 logits (canvas tokens x vocabulary x 4,
    written and read back, read again by the soft embedding) and the bfloat16 LM head with the
    vocabulary, and by K and V of every cached position a layer attends to with the cached length."""
    config = load_config(tiny)
    g = config.arch

    def denoise(config, start: int):
        return plan_cost(config, [Row(0, start, CANVAS, True)], [2], 0, 2).bytes

    wider = dataclasses.replace(config, vocab_size=config.vocab_size + 1000)
    assert denoise(wider, 3) - denoise(config, 3) == pytest.approx(1000 * (3 * 4 * CANVAS + 2 * 2 * g.hidden_size))
    kv = [2 * 2 * s.num_kv_heads * s.head_dim for s in g.layers]  # K and V bytes of a position, per layer
    assert denoise(config, 3) - denoise(config, 1) == pytest.approx(2 * sum(kv))  # within every window
    full = [b for b, s in zip(kv, g.layers) if not s.sliding]
    assert 0 < len(full) < len(kv)
    assert denoise(config, 30) - denoise(config, 20) == pytest.approx(10 * sum(full))  # past the sliding window


def test_generate_costs_share_the_weights_across_the_batch(tiny):
    config = load_config(tiny)
    one, two = generate_costs(config, 1, 5, 2 * CANVAS, 3, 2), generate_costs(config, 2, 5, 2 * CANVAS, 3, 2)
    assert len(one) == len(two) == 1 + 2 * 3 + 1  # a prefill, 3 steps per canvas, one commit
    for a, b in zip(one, two):
        assert b.flops == pytest.approx(2 * a.flops) and a.bytes < b.bytes < 2 * a.bytes


server = serve(fixture_value("tiny"), "--max-num-seqs", "4")


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
                  "Request throughput (req/s):", "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
                  "Total Token throughput (tok/s):",
                  "Time to First Token", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "Time per Output Token (excl. 1st token)", "Mean TPOT (ms):", "Inter-token Latency", "Mean ITL (ms):",
                  "End-to-end Latency", "P99 E2EL (ms):", "Diffusion Decoding", "Committed throughput (tok/s):",
                  "Denoising steps per canvas:", "Committed tokens per denoising step:", "Committed tokens:",
                  "Denoising steps:", "Canvas positions evaluated:"):
        assert label in report, label
    saved = json.loads(result.read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0
    assert saved["total_input_tokens"] == 6 * 6 and saved["total_output_tokens"] == 6 * 16
    # Without --save-detailed, vLLM's per-request lists are left out (its latencies and queue times stay).
    assert not {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"} & set(saved)
    assert len(saved["latencies"]) == len(saved["queue_times"]) == 6
    d = saved["diffusion"]
    # ignore_eos and a stability threshold no canvas reaches: 2 canvases per request, 3 steps each
    assert d["canvases"] == 12 and d["denoising_steps"] == 36 and d["denoising_steps_per_canvas"] == 3
    assert d["canvas_positions_evaluated"] == 36 * CANVAS and d["committed_tokens"] == 96
    assert saved["mean_ttft_ms"] > 0 and saved["p99_e2el_ms"] >= saved["median_e2el_ms"] > 0
    # At most all 96 tokens in one second, at least what the run's seconds average
    assert saved["output_throughput"] <= saved["max_output_tokens_per_s"] * (1 + 1 / saved["duration"]) and \
        saved["max_output_tokens_per_s"] <= 96


def test_peak_output_throughput_counts_a_canvas_chunk_as_its_tokens():
    """vLLM's one-second buckets from the run's start; a chunk carries the tokens of its text's share."""
    from blockdiff.bench.serve import RequestOutput, compute_metrics

    a = RequestOutput(success=True, output_tokens=30, start_time=100.0, ttft=0.2, itl=[0.5, 1.0], latency=1.7,
                      arrival_chars=[10, 10, 10])  # 10 tokens at 0.2 s, 10 at 0.7 s, 10 at 1.7 s
    b = RequestOutput(success=True, output_tokens=8, start_time=100.5, ttft=1.0, itl=[0.1], latency=1.1,
                      arrival_chars=[6, 2])  # 6 tokens at 1.5 s, 2 at 1.6 s
    assert compute_metrics([a, b], 2.0, [99], start=100.0)["max_output_tokens_per_s"] == pytest.approx(20.0)


def test_bench_plot(serve_run, tmp_path):
    png = tmp_path / "latency.png"
    assert main(["bench", "plot", str(serve_run[1]), "--output", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _parse_serve_args(*argv: str):
    from blockdiff.bench.serve import add_arguments
    from blockdiff.entrypoints.cli import Parser

    p = Parser()
    add_arguments(p)
    return p.parse_args(list(argv))


def _serve_args(*argv: str):
    return _parse_serve_args("--dataset-name", "prefix-repetition", "--num-prompts", "6", "--prefix-repetition-prefix-len",
                             "10", "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "2",
                             "--prefix-repetition-output-len", "24", *argv)


def test_prefix_repetition_prompts_share_prefixes_and_not_suffixes(tiny):
    from blockdiff.bench.datasets import special_token_ids
    from blockdiff.bench.serve import make_samples

    samples = make_samples(_serve_args("--model", tiny), chat=False)
    prompts = [s.prompt for s in samples]
    assert [s.prompt_len for s in samples] == [14] * 6 and [len(p) for p in prompts] == [14] * 6
    assert [s.output_len for s in samples] == [24] * 6
    prefixes = [tuple(p[:10]) for p in prompts]
    assert prefixes[0] != prefixes[1] and prefixes == [prefixes[0], prefixes[1]] * 3
    assert len({tuple(p[10:]) for p in prompts}) == 6
    special = special_token_ids(load_config(tiny))
    assert not special & {t for p in prompts for t in p}
    # Without any tokenizer (a server with no /tokenize), prompts are words, shared and unique the same way.
    words = [s.prompt.split() for s in make_samples(_serve_args(), chat=False)]
    assert [len(w) for w in words] == [14] * 6
    assert len({tuple(w[:10]) for w in words}) == 2 and len({tuple(w[10:]) for w in words}) == 6
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes"):
        make_samples(_serve_args("--prefix-repetition-num-prefixes", "7"), chat=False)


def test_text_prompts_have_exactly_the_asked_tokens_of_the_tokenizer(tiny):
    """For a chat endpoint, prompts are text; sized with the checkpoint's tokenizer they encode to
    exactly the drawn length (a completion prompt: one token fewer, for the BOS the server adds)."""
    from blockdiff.bench.prompt_tokens import LocalTokenizer
    from blockdiff.bench.serve import make_samples
    from blockdiff.tokenizer import Tokenizer

    tok = LocalTokenizer(Tokenizer.from_pretrained(tiny))
    args = _parse_serve_args("--tokenizer", tiny, "--random-input-len", "40", "--random-output-len", "10",
                             "--random-range-ratio", "0.5", "--num-prompts", "12")
    chat = make_samples(args, chat=True)
    assert all(isinstance(s.prompt, str) and len(tok.encode(s.prompt)) == s.prompt_len for s in chat)
    assert all(20 <= s.prompt_len <= 60 and 5 <= s.output_len <= 15 for s in chat)
    assert len({s.prompt_len for s in chat}) > 3 and len({s.output_len for s in chat}) > 3  # spread, not fixed
    fixed = make_samples(_parse_serve_args("--tokenizer", tiny, "--random-input-len", "40", "--num-prompts", "3"), chat=True)
    assert [s.prompt_len for s in fixed] == [40] * 3 and [s.output_len for s in fixed] == [128] * 3
    with pytest.raises(ValueError, match="--random-range-ratio must be in"):
        make_samples(_parse_serve_args("--tokenizer", tiny, "--random-range-ratio", "1"), chat=True)


def test_arrivals_follow_the_rate_and_the_burstiness():
    """vLLM's arrivals: gamma-distributed gaps of mean 1/rate, rescaled to end at n/rate; a lower
    burstiness makes the gaps more uneven (a gamma of shape k has a coefficient of variation 1/sqrt k)."""
    from blockdiff.bench.serve import arrival_delays

    def spread(burstiness: float) -> float:
        gaps = np.diff([0.0, *arrival_delays(4000, 10.0, burstiness, seed=3)])
        return float(gaps.std() / gaps.mean())

    for b in (0.25, 1.0, 4.0):
        assert arrival_delays(4000, 10.0, b, seed=3)[-1] == pytest.approx(400.0)
    assert spread(0.25) == pytest.approx(2.0, rel=0.15) and spread(1.0) == pytest.approx(1.0, rel=0.1)
    assert spread(4.0) == pytest.approx(0.5, rel=0.1)
    assert arrival_delays(4, 2.0, float("inf"), seed=0) == [0.5, 1.0, 1.5, 2.0]
    assert arrival_delays(3, float("inf"), 0.5, seed=0) == [0.0] * 3


@pytest.mark.parametrize("argv, path, chat", [
    ([], "/v1/completions", False),
    (["--backend", "vllm"], "/v1/completions", False),
    (["--backend", "openai-chat"], "/v1/chat/completions", True),
    (["--endpoint", "/v1/chat/completions"], "/v1/chat/completions", True),
    (["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"], "/v1/chat/completions", True),
])
def test_backend_and_endpoint_choose_the_body(argv, path, chat):
    from blockdiff.bench.serve import endpoint

    assert endpoint(_parse_serve_args(*argv)) == (path, chat)


@pytest.mark.parametrize("argv", [["--backend", "openai", "--endpoint", "/v1/chat/completions"],
                                  ["--backend", "openai-chat", "--endpoint", "/v1/completions"]])
def test_a_backend_that_contradicts_the_endpoint_is_refused(argv):
    from blockdiff.bench.serve import endpoint

    with pytest.raises(ValueError, match="does not send the bodies of --endpoint"):
        endpoint(_parse_serve_args(*argv))


def test_an_unwritable_result_path_is_refused_before_the_run(server, tiny, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    before = server.metrics().total("vllm:prompt_tokens_total")
    argv = ["bench", "serve", "--base-url", server.url, "--model", tiny, "--random-input-len", "4",
            "--random-output-len", "8", "--num-prompts", "2", "--save-result", "--result-filename", str(blocker / "r.json")]
    assert main(argv) == 1
    assert "error: cannot make the folder of the result file" in capsys.readouterr().err
    assert server.metrics().total("vllm:prompt_tokens_total") == before  # no request was sent


demo_server = serve(None, "--max-num-seqs", "4")


@pytest.mark.slow  # a bench run against the demo server: ~20 s on 2 cores
def test_the_seeds_bench_command_runs_as_written(demo_server, tmp_path):
    """vLLM's command from the seed, only the model and lengths adapted: the served name (no local
    tokenizer), a relative result path whose folder does not exist yet; prompts of exactly 64 tokens of
    the served tokenizer, and the per-request records vLLM's --save-detailed writes."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "blockdiff", "bench", "serve", "--backend", "vllm", "--base-url",
           f"http://localhost:{demo_server.port}", "--model", "demo", "--dataset-name", "random", "--random-input-len",
           "64", "--random-output-len", "64", "--ignore-eos", "--num-prompts", "4", "--max-concurrency", "1",
           "--save-result", "--save-detailed", "--result-filename", "results/diffusion.json"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result" in done.stdout and "results saved to results/diffusion.json" in done.stdout
    saved = json.loads((tmp_path / "results" / "diffusion.json").read_text())
    assert (saved["backend"], saved["model_id"], saved["completed"], saved["failed"]) == ("vllm", "demo", 4, 0)
    assert saved["input_lens"] == [64] * 4 and saved["total_input_tokens"] == 256  # the server's own count
    assert saved["output_lens"] == [64] * 4 and saved["total_output_tokens"] == 256
    assert all(t > 0 for t in saved["ttfts"]) and [len(i) for i in saved["itls"]] == [7] * 4  # 8 canvases of 8
    assert all(lat > t for lat, t in zip(saved["latencies"], saved["ttfts"]))
    starts = saved["start_times"]
    assert starts == sorted(starts) and all(b - a >= lat for a, b, lat in zip(starts, starts[1:], saved["latencies"]))
    assert len(saved["generated_texts"]) == 4 and all(isinstance(t, str) and t for t in saved["generated_texts"])
    assert saved["errors"] == [""] * 4 and saved["max_concurrent_requests"] == 1
    assert saved["diffusion_committed_tokens"] == 256 and saved["diffusion_denoising_steps"] > 0
    assert saved["mean_ttft_ms"] > 0 and saved["p99_itl_ms"] >= saved["median_itl_ms"] > 0


def test_chat_endpoint_with_a_sharegpt_file_sends_chat_bodies(demo_server, tmp_path, capsys):
    """`--endpoint /v1/chat/completions` sends chat bodies: the demo answers its chat tasks right
    (a completion body would give it a raw prompt, and noise back). The ShareGPT file's second turns
    set max_tokens; a conversation of one turn is skipped."""
    data = [{"conversations": [{"from": "human", "value": "sort: 3 1 2"}, {"from": "gpt", "value": "1 2 3"}]},
            {"conversations": [{"from": "human", "value": "reverse: block"}, {"from": "gpt", "value": "kcolb"}]},
            {"conversations": [{"from": "human", "value": "upper: x"}]},
            {"conversations": [{"from": "human", "value": "upper: diffusion"}, {"from": "gpt", "value": "DIFFUSION"}]}]
    (tmp_path / "sharegpt.json").write_text(json.dumps(data))
    result = tmp_path / "chat.json"
    argv = ["bench", "serve", "--base-url", demo_server.url, "--endpoint", "/v1/chat/completions", "--dataset-name",
            "sharegpt", "--dataset-path", str(tmp_path / "sharegpt.json"), "--num-prompts", "3", "--temperature", "0",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-filename", str(result)]
    assert main(argv) == 0
    saved = json.loads(result.read_text())
    assert saved["backend"] == "openai-chat" and saved["completed"] == 3
    answers = {"1 2 3", "kcolb", "DIFFUSION"}
    assert set(saved["generated_texts"]) == answers
    # One arrival per committed canvas: the opening chunk (the role, no text) is not a token.
    assert sum(map(len, saved["itls"])) == saved["diffusion"]["canvases"] - 3


def test_sharegpt_samples_take_the_first_two_turns(tiny, tmp_path):
    from blockdiff.bench.datasets import sharegpt_samples
    from blockdiff.bench.prompt_tokens import LocalTokenizer
    from blockdiff.tokenizer import Tokenizer

    tok = LocalTokenizer(Tokenizer.from_pretrained(tiny))
    data = [{"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "general kenobi"},
                               {"from": "human", "value": "a third turn is not read"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "too short a prompt"}]},
            {"id": "no conversations"}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    samples = sharegpt_samples(str(path), 3, 0, tok, tok.special_tokens, None)
    want = (1 + len(tok.encode("hello there")), len(tok.encode("general kenobi")))
    assert [(s.prompt, s.prompt_len, s.output_len) for s in samples] == [("hello there", *want)] * 3  # repeated to 3
    assert [s.output_len for s in sharegpt_samples(str(path), 1, 0, tok, 0, 7)] == [7]
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        sharegpt_samples(str(path), 1, 0, tok, 0, None)


def test_sequence_flops_is_the_docstring_formula(tiny):
    """roofline.sequence_flops, counted by hand: 2 x active parameters x tokens (the prompt, each
    canvas once per step, each committed canvas once more) + LM head + soft embedding + the
    self-conditioning MLP + attention over the keys each query sees."""
    from blockdiff.bench.roofline import _token_weights, sequence_flops

    config = load_config(tiny)
    g, cl = config.arch, config.canvas_length
    h, v = g.hidden_size, config.vocab_size
    prompt, new, steps = 7, 3 * cl, 4
    active = sum(dense + g.top_k_experts * expert for dense, expert in (_token_weights(g, s) for s in g.layers))
    tokens = prompt + steps * new + (new - cl)
    want = 2 * active * tokens + steps * new * 2 * h * v + (steps - 1) * new * 2 * v * h
    want += (steps - 1) * new * 2 * 3 * h * g.intermediate_size
    for spec in g.layers:
        window = spec.window if spec.sliding else None
        per_key = 4 * g.num_heads * spec.head_dim
        seen = lambda pos: pos + 1 if window is None else min(pos + 1, window)  # causal, window included
        want += per_key * sum(seen(i) for i in range(prompt + new - cl))  # the prompt and committed canvases
        for c in range(new // cl):
            start = prompt + c * cl
            cached = start if window is None else min(start, window - 1)
            want += per_key * steps * cl * (cached + cl)
    assert sequence_flops(config, prompt, new, steps) == pytest.approx(want)
