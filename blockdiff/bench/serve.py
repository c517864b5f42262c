"""`blockdiff bench serve`: load an OpenAI-compatible server the way `vllm bench serve` does, with
its flags, and print the same sections and labels, plus a Diffusion Decoding section when the
server reports `usage.diffusion` (blockdiff does: canvases, denoising steps, canvas positions
evaluated). The result JSON has vLLM's fields, with `--save-detailed` its per-request lists.

Requests stream from /v1/completions (`--backend vllm` or `openai`) or /v1/chat/completions
(`--backend openai-chat`, one user message of text parts). Every streamed chunk with text is a
token arrival, as in vLLM: time to first token is the first chunk, inter-token latency the gap
between chunks. A blockdiff server streams one chunk per committed canvas, so its inter-token
latency is the time between canvases; time per output token divides the rest of the request by
its tokens. A chat stream's opening chunk (the role, no text) is not a token arrival.

Prompts hold exactly the asked-for number of tokens of the tokenizer they are sized with
(bench/prompt_tokens.py): a local checkpoint's, else the served model's through /tokenize.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx
import numpy as np

from blockdiff.arg_utils import at_least, port
from blockdiff.bench.datasets import (Sample, fit_text, prefix_repetition_prompts, random_token_prompts,
                                      sharegpt_samples, special_token_ids, spread_lengths, tokenized_word_prompts,
                                      word_prompts)
from blockdiff.bench.prompt_tokens import LocalTokenizer, PromptTokenizer, ServerTokenizer

BACKENDS = {"vllm": "/v1/completions", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
DATASETS = ["random", "prefix-repetition", "sharegpt"]
# What `--save-detailed` keeps: vLLM's per-request lists (benchmarks/serve.py drops these without it).
# vLLM's sampling flags, each sent as the request field of its name when given.
SAMPLING_FLAGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "denoising_mode": str}
DETAILED = ["input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=list(BACKENDS), default=None,
                   help="vllm, openai: completion bodies; openai-chat: chat bodies (default: what --endpoint takes)")
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/chat/completions for --backend openai-chat, else /v1/completions)")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint directory whose tokenizer sizes the prompts (default: --model if it is a "
                        "directory, else the server's own through /tokenize)")
    p.add_argument("--label", default=None, help="prefix of the default result file name (default: --backend)")
    p.add_argument("--dataset-name", default="random", choices=DATASETS, type=lambda s: s.replace("_", "-"),
                   help="random: prompts of random tokens; prefix-repetition: a few random prefixes, each "
                        "shared by many prompts, every prompt with a random suffix of its own; sharegpt: the "
                        "conversations of --dataset-path")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (--dataset-name sharegpt)")
    p.add_argument("--input-len", type=at_least(1), default=None, help="sets --random-input-len (vLLM's general form)")
    p.add_argument("--output-len", type=at_least(1), default=None,
                   help="sets the output length of every dataset (vLLM's general form)")
    p.add_argument("--random-input-len", type=at_least(1), default=1024)
    p.add_argument("--random-output-len", type=at_least(1), default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="r in [0, 1): each prompt's input and output lengths are drawn uniformly from "
                        "[len (1 - r), len (1 + r)]")
    p.add_argument("--prefix-repetition-prefix-len", type=at_least(1), default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=at_least(1), default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=at_least(1), default=10)
    p.add_argument("--prefix-repetition-output-len", type=at_least(1), default=128)
    p.add_argument("--sharegpt-output-len", type=at_least(1), default=None,
                   help="max_tokens of every ShareGPT request (default: the tokens of the conversation's answer)")
    p.add_argument("--num-prompts", type=at_least(1), default=1000)
    p.add_argument("--max-concurrency", type=at_least(1), default=None, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (inf: all at once); arrivals as --burstiness sets them")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma distribution of the gaps between arrivals: 1 is a Poisson process, "
                        "below 1 burstier, above 1 more even")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos so every request makes all its tokens (always so with --dataset-name random, "
                        "as in vLLM)")
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help='JSON merged into every request, e.g. \'{"max_denoising_steps": 8}\'')
    for name, kind in SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=f"{name} sent in every request (default: the server's)")
    p.add_argument("--num-warmups", type=at_least(0), default=0,
                   help="requests of the first prompt sent (at --max-concurrency) before the timed run")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE",
                   help="pairs saved in the result JSON, e.g. version=0.1.0 tp=1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true", help="write the results to a JSON file")
    p.add_argument("--save-detailed", action="store_true",
                   help="with --save-result, also each request's input and output length, TTFT, ITLs, start "
                        "time, text and error")
    p.add_argument("--result-dir", default=None, help="folder of the result file (made if missing)")
    p.add_argument("--result-filename", default=None,
                   help="result file name (default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json); its folder is made "
                        "if missing")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--ready-check-timeout-sec", type=int, default=600,
                   help="keep retrying the first test request this long (0: no test request)")


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    queue_time: float = 0.0  # waiting for --max-concurrency before it was sent
    diffusion: dict | None = None
    # Characters each arrival brought, the first included: a chunk carries a canvas's tokens, so
    # the peak throughput spreads the usage's tokens over the arrivals by their text.
    arrival_chars: list[int] = field(default_factory=list)


def _arrival(choice: dict, chat: bool) -> tuple[bool, str]:
    """(whether a streamed choice counts as a token arrival, the text it adds)."""
    if not chat:
        return True, choice.get("text") or ""  # as vLLM: any completion chunk, even one with no text
    delta = choice.get("delta") or {}
    text = delta.get("content") or ""
    return bool(text or delta.get("reasoning_content") or delta.get("tool_calls") or choice.get("finish_reason")), text


async def send_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict, prompt_len: int,
                       chat: bool) -> RequestOutput:
    out = RequestOutput(prompt_len=prompt_len, start_time=time.perf_counter())
    last = out.start_time
    first = True
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:500]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])
                    return out
                choices = chunk.get("choices") or []
                if choices:
                    arrived, text = _arrival(choices[0], chat)
                    if arrived:
                        now = time.perf_counter()
                        if first:
                            out.ttft, first = now - out.start_time, False
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.arrival_chars.append(len(text))
                    out.generated_text += text
                usage = chunk.get("usage")
                if usage:
                    out.output_tokens = usage.get("completion_tokens") or 0
                    out.prompt_len = usage.get("prompt_tokens") or out.prompt_len
                    out.diffusion = usage.get("diffusion")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if first:
        out.error = "the stream ended without a completion chunk"
        return out
    out.latency = last - out.start_time
    out.success = True
    return out


def request_body(sample: Sample, model: str, chat: bool, args: argparse.Namespace) -> dict:
    """The body `vllm bench serve` sends for `sample` (endpoint_request_func.py)."""
    if chat:
        body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": sample.prompt}]}],
                "max_completion_tokens": sample.output_len}
    else:
        body = {"model": model, "prompt": sample.prompt, "max_tokens": sample.output_len}
    body.update(stream=True, stream_options={"include_usage": True})
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update({k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None})
    body.update(args.extra_body or {})
    return body


def _local_source(args: argparse.Namespace) -> str | None:
    return args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)


def make_samples(args: argparse.Namespace, chat: bool, server: ServerTokenizer | None = None) -> list[Sample]:
    """The prompts of the chosen dataset. Sized with the local checkpoint's tokenizer when one is
    given, else with `server`'s; a completions endpoint with a local checkpoint gets token ids
    (exact by construction), every other case text. With no tokenizer at all (a server without
    /tokenize), random prompts are random words, whose token counts come back in the usage."""
    source = _local_source(args)
    tok: PromptTokenizer | None = server
    vocab = None
    if source is not None:
        from blockdiff.model.registry import load_config
        from blockdiff.tokenizer import Tokenizer

        local = Tokenizer.from_pretrained(source)
        tok = LocalTokenizer(local) if local is not None else None
        if os.path.isfile(os.path.join(source, "config.json")):  # a checkpoint, not a tokenizer alone
            config = load_config(source)
            vocab = (config.vocab_size, special_token_ids(config))
        if tok is None and (vocab is None or chat or args.dataset_name == "sharegpt"):
            raise ValueError(f"{source} has no tokenizer.json: text prompts need one (pass --tokenizer)")
    # What a completion prompt gets on top of its text (BOS); a chat's template adds its own.
    text_special = 0 if chat or tok is None else tok.special_tokens
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (ShareGPT-format JSON)")
        if tok is None:
            raise ValueError("--dataset-name sharegpt counts tokens with a tokenizer, but the server has no /tokenize: "
                             "pass --tokenizer DIR")
        return sharegpt_samples(args.dataset_path, args.num_prompts, args.seed, tok, text_special,
                                args.sharegpt_output_len)
    if args.dataset_path is not None:
        raise ValueError(f"--dataset-path is for --dataset-name sharegpt, not {args.dataset_name}")

    token_ids = vocab is not None and not chat  # sent as ids: no BOS is added to them
    special = 0 if token_ids else text_special
    if token_ids:
        def draw(lengths: list[int], seed: int) -> list:
            return random_token_prompts(lengths, vocab[0], vocab[1], seed)
    elif tok is not None:
        def draw(lengths: list[int], seed: int) -> list:
            return tokenized_word_prompts(tok, lengths, seed)
    else:
        print("The server has no /tokenize: prompts are random words; their token counts come from the usage")
        draw = word_prompts
    if args.dataset_name == "prefix-repetition":
        prefix = args.prefix_repetition_prefix_len - special
        if prefix < 1:
            raise ValueError(f"--prefix-repetition-prefix-len must exceed the {special} special token(s) a prompt gets")
        sequences = prefix_repetition_prompts(draw, args.num_prompts, prefix, args.prefix_repetition_suffix_len,
                                              args.prefix_repetition_num_prefixes, args.seed)
        outputs = [args.prefix_repetition_output_len] * args.num_prompts
    else:
        rng = np.random.default_rng(args.seed)
        lengths = spread_lengths(args.num_prompts, args.random_input_len, args.random_range_ratio, rng,
                                 minimum=special + 1)
        outputs = spread_lengths(args.num_prompts, args.random_output_len, args.random_range_ratio, rng, minimum=1)
        sequences = draw([n - special for n in lengths], args.seed)
    if token_ids:
        return [Sample(s, len(s), n) for s, n in zip(sequences, outputs)]
    if tok is None:
        return [Sample(" ".join(s), len(s), n) for s, n in zip(sequences, outputs)]
    samples, off = [], 0
    for i, (ids, n) in enumerate(zip(sequences, outputs)):
        text, count = fit_text(tok, ids, lambda k, i=i: tokenized_word_prompts(tok, [k], args.seed + 2 + i)[0])
        off += count != len(ids)
        samples.append(Sample(text, count + special, n))
    if off:
        print(f"{off} of {len(samples)} prompts could not be made of exactly their token count (it is recorded)")
    return samples


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent, as vLLM draws them: gaps from a gamma
    distribution of shape `burstiness` and mean 1/rate (burstiness 1: a Poisson process), rescaled so
    the last arrival falls at n/rate, which steadies the throughput over seeds."""
    if rate == float("inf"):
        return [0.0] * n
    if burstiness == float("inf"):
        return [(i + 1) / rate for i in range(n)]
    rng = np.random.default_rng(seed)
    delays = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))
    return (delays * (n / rate) / delays[-1]).tolist()


def _stats(values: list[float], percentiles: list[float]) -> dict:
    arr = np.array(values or [0.0]) * 1000
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{_pname(p)}"] = float(np.percentile(arr, p))
    return out


def _pname(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def compute_metrics(outputs: list[RequestOutput], duration: float, percentiles: list[float], start: float) -> dict:
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(output_lens)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time - start for o in outputs],  # seconds after the run started
        "queue_times": [o.queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_concurrent_requests": _peak_concurrency(ok),
        "max_output_tokens_per_s": _peak_output_rate(ok, start),
    }
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": tpots,
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    for name, values in series.items():
        for stat, value in _stats(values, percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    reports = [o.diffusion for o in ok if o.diffusion]
    if reports:
        canvases = sum(d.get("canvases", 0) for d in reports)
        steps = sum(d.get("denoising_steps", 0) for d in reports)
        committed = sum(o.output_tokens for o in ok if o.diffusion)
        d = result["diffusion"] = {
            "committed_throughput": committed / duration,
            "denoising_steps_per_canvas": steps / canvases if canvases else 0.0,
            "committed_tokens_per_denoising_step": committed / steps if steps else 0.0,
            "committed_tokens": committed,
            "canvases": canvases,
            "denoising_steps": steps,
            "canvas_positions_evaluated": sum(d.get("canvas_positions_evaluated", 0) for d in reports),
        }
        # what the fast denoising mode saves: forwards and model rows per committed token
        d["denoising_steps_per_committed_token"] = steps / committed if committed else 0.0
        d["rows_per_committed_token"] = d["canvas_positions_evaluated"] / committed if committed else 0.0
        # vLLM's names for the same figures (it reads them from the server's vllm:diffusion_* counters)
        result.update(diffusion_committed_throughput=d["committed_throughput"],
                      diffusion_steps_per_canvas=d["denoising_steps_per_canvas"],
                      diffusion_committed_per_step=d["committed_tokens_per_denoising_step"],
                      diffusion_committed_tokens=committed, diffusion_denoising_steps=steps,
                      diffusion_canvas_positions=d["canvas_positions_evaluated"])
    return result


def _peak_concurrency(ok: list[RequestOutput]) -> int:
    """Most requests in flight at once, over half-open [start, end) intervals."""
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def _peak_output_rate(ok: list[RequestOutput], start: float) -> float:
    """The most output tokens that arrived within one second of the run (vLLM's one-second buckets
    from the run's start). vLLM counts a token per streamed chunk; here a chunk holds a canvas's
    tokens, so each request's tokens are spread over its arrivals by the characters each brought
    (evenly where the text is empty)."""
    buckets: dict[int, float] = {}
    for o in ok:
        times = o.start_time + o.ttft + np.cumsum([0.0, *o.itl])
        chars = np.array(o.arrival_chars[: len(times)], dtype=float)
        share = chars / chars.sum() if len(chars) == len(times) and chars.sum() > 0 else np.full(len(times), 1 / len(times))
        for t, tokens in zip(times, share * o.output_tokens):
            bucket = int(t - start)
            buckets[bucket] = buckets.get(bucket, 0.0) + tokens
    return max(buckets.values(), default=0.0)


_TOTALS = [
    ("Benchmark duration (s):", "duration"),
    ("Total input tokens:", "total_input_tokens"),
    ("Total generated tokens:", "total_output_tokens"),
    ("Request throughput (req/s):", "request_throughput"),
    ("Output token throughput (tok/s):", "output_throughput"),
    ("Peak output token throughput (tok/s):", "max_output_tokens_per_s"),
    ("Peak concurrent requests:", "max_concurrent_requests"),
    ("Total Token throughput (tok/s):", "total_token_throughput"),
]
_DIFFUSION = [
    ("Committed throughput (tok/s):", "committed_throughput"),
    ("Denoising steps per canvas:", "denoising_steps_per_canvas"),
    ("Committed tokens per denoising step:", "committed_tokens_per_denoising_step"),
    ("Committed tokens:", "committed_tokens"),
    ("Denoising steps:", "denoising_steps"),
    ("Canvas positions evaluated:", "canvas_positions_evaluated"),
    ("Denoising steps per committed token:", "denoising_steps_per_committed_token"),
    ("Rows evaluated per committed token:", "rows_per_committed_token"),
]
_SECTIONS = [
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
]


def print_report(result: dict, args: argparse.Namespace, selected: list[str], percentiles: list[float]) -> None:
    def line(label: str, value) -> None:
        print(("{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}").format(label, value))

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Successful requests:", result["completed"])
    line("Failed requests:", result["failed"])
    if args.max_concurrency is not None:
        line("Maximum request concurrency:", args.max_concurrency)
    if args.request_rate != float("inf"):
        line("Request rate configured (RPS):", float(args.request_rate))
    for label, key in _TOTALS:
        line(label, result[key])
    for key, short, header in _SECTIONS:
        if key not in selected:
            continue
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        line(f"Mean {short} (ms):", result[f"mean_{key}_ms"])
        line(f"Median {short} (ms):", result[f"median_{key}_ms"])
        for p in percentiles:
            line(f"P{_pname(p)} {short} (ms):", result[f"p{_pname(p)}_{key}_ms"])
    d = result.get("diffusion")
    if d:
        print("{s:{c}^{n}}".format(s="Diffusion Decoding", n=50, c="-"))
        for label, key in _DIFFUSION:
            line(label, d[key])
    print("=" * 50)


def _first_model(client: httpx.Client, base_url: str, headers: dict) -> str:
    resp = client.get(base_url + "/v1/models", headers=headers)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


def _check_reachable(client: httpx.Client, base_url: str) -> None:
    """Fail at once when nothing listens (the ready check waits for a server that is still
    loading, not for one that was never started)."""
    try:
        client.get(base_url + "/health", timeout=10)
    except httpx.TransportError:
        raise ConnectionError(f"cannot reach {base_url}: is blockdiff serve running?") from None


def endpoint(args: argparse.Namespace) -> tuple[str, bool]:
    """(the API path, whether it takes chat bodies) from --backend and --endpoint, either of which
    may be left out; they must agree when both are given."""
    path = args.endpoint or BACKENDS[args.backend or "openai"]
    chat = path.rstrip("/").endswith("chat/completions")
    if args.backend is not None and chat != (args.backend == "openai-chat"):
        want = "openai-chat" if chat else "vllm or openai"
        raise ValueError(f"--backend {args.backend} does not send the bodies of --endpoint {path}: use --backend {want}")
    return path, chat


async def benchmark(args: argparse.Namespace, url: str, model: str, samples: list[Sample], chat: bool,
                    headers: dict) -> dict:
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    limits = httpx.Limits(max_connections=args.max_concurrency or len(samples), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0, connect=30.0), limits=limits) as client:
        async def send(sample: Sample) -> RequestOutput:
            return await send_request(client, url, request_body(sample, model, chat, args), headers, sample.prompt_len, chat)

        if args.ready_check_timeout_sec > 0:
            print("Starting initial single prompt test run...")
            deadline = time.monotonic() + args.ready_check_timeout_sec
            while True:
                test = await send(samples[0])
                if test.success:
                    break
                if time.monotonic() > deadline or test.error.startswith("HTTP 4"):
                    raise ValueError(f"Initial test run failed: {test.error}")
                await asyncio.sleep(1.0)
            print("Initial test run completed.")
        if args.num_warmups:
            print(f"Warming up with {args.num_warmups} requests...")
            warm = asyncio.Semaphore(args.max_concurrency or args.num_warmups)

            async def warmup() -> None:
                async with warm:
                    await send(samples[0])

            await asyncio.gather(*(warmup() for _ in range(args.num_warmups)))
            print("Warmup run completed.")
        print("Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Burstiness factor: {args.burstiness} ({'Poisson process' if args.burstiness == 1 else 'Gamma distribution'})")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        pbar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(samples))
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        delays = arrival_delays(len(samples), args.request_rate, args.burstiness, args.seed)
        start = time.perf_counter()

        async def one(sample: Sample, delay: float) -> RequestOutput:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            arrived = time.perf_counter()
            if gate is None:
                out = await send(sample)
            else:
                async with gate:
                    out = await send(sample)
            out.queue_time = out.start_time - arrived
            if pbar is not None:
                pbar.update(1)
            return out

        outputs = await asyncio.gather(*(one(s, d) for s, d in zip(samples, delays)))
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()

    result = compute_metrics(outputs, duration, percentiles, start)
    print_report(result, args, selected, percentiles)
    return result


def result_path(args: argparse.Namespace, label: str, model: str, date: str) -> str:
    """Where --save-result writes, as vLLM names it; its folder is made now, before the run, and a
    path that cannot be written is refused now rather than after it."""
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        rate = args.request_rate if args.request_rate != float("inf") else "inf"
        name = f"{label}-{rate}qps{concurrency}-{model.rstrip('/').split('/')[-1] or 'model'}-{date}.json"
    path = os.path.join(args.result_dir, name) if args.result_dir else name
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot make the folder of the result file {path}: {e.strerror or e}") from None
    if os.path.isdir(path) or not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OSError(f"cannot write the result file {path}")
    return path


def run(args: argparse.Namespace) -> int:
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    metadata = {}
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata takes KEY=VALUE pairs, got {item!r}")
        metadata[key.strip()] = value.strip()
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.sharegpt_output_len = args.output_len
    if args.dataset_name == "random":  # as vLLM: random prompts run to their length
        args.ignore_eos = True
    path, chat = endpoint(args)
    backend = args.backend or ("openai-chat" if chat else "openai")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the report
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        _check_reachable(client, base_url)
        model = args.model or _first_model(client, base_url, headers)
        result_file = result_path(args, args.label or backend, model, date) if args.save_result else None
        server = None if _local_source(args) else ServerTokenizer.probe(client, base_url, model, headers)
        samples = make_samples(args, chat, server)
    result = asyncio.run(benchmark(args, base_url + path, model, samples, chat, headers))
    result = {
        "date": date,
        "endpoint_type": backend,  # vLLM writes both
        "backend": backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": _local_source(args) or (model if server is not None else None),
        "num_prompts": args.num_prompts,
        **metadata,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **result,
        "base_url": base_url,
        "endpoint": path,
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "prefix_repetition_prefix_len": args.prefix_repetition_prefix_len,
        "prefix_repetition_suffix_len": args.prefix_repetition_suffix_len,
        "prefix_repetition_num_prefixes": args.prefix_repetition_num_prefixes,
        "prefix_repetition_output_len": args.prefix_repetition_output_len,
        "sharegpt_output_len": args.sharegpt_output_len,
        "ignore_eos": args.ignore_eos,
        "extra_body": args.extra_body,
        **{k: getattr(args, k) for k in SAMPLING_FLAGS},
        "seed": args.seed,
    }
    if result_file is not None:
        if not args.save_detailed:
            for key in DETAILED:
                result.pop(key)
        with open(result_file, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results saved to {result_file}")
    return 0 if result["completed"] else 1
