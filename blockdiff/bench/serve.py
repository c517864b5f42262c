"""`blockdiff bench serve`: load an OpenAI-compatible server the way `vllm bench serve` does and
print the same sections and labels, plus a Diffusion Decoding section when the server reports
`usage.diffusion` (blockdiff does: canvases, denoising steps, canvas positions evaluated).

Requests stream from /v1/completions. Every streamed chunk with text is a token arrival, as in
vLLM: time to first token is the first chunk, inter-token latency the gap between chunks. A
blockdiff server streams one chunk per committed canvas, so its inter-token latency is the time
between canvases; time per output token divides the rest of the request by its tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx
import numpy as np

from blockdiff.bench.datasets import prefix_repetition_prompts, random_token_prompts, special_token_ids
from blockdiff.arg_utils import at_least, port

# Words for text prompts when no local checkpoint tells the vocabulary (any OpenAI server).
_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word"
).split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint directory whose vocabulary random prompts are drawn from (default: --model "
                        "if it is a directory; otherwise prompts are random words)")
    p.add_argument("--dataset-name", default="random", choices=["random", "prefix-repetition"],
                   help="random: prompts of random tokens; prefix-repetition: a few random prefixes, each "
                        "shared by many prompts, every prompt with a random suffix of its own")
    p.add_argument("--random-input-len", type=at_least(1), default=1024)
    p.add_argument("--random-output-len", type=at_least(1), default=128)
    p.add_argument("--prefix-repetition-prefix-len", type=at_least(1), default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=at_least(1), default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=at_least(1), default=10)
    p.add_argument("--prefix-repetition-output-len", type=at_least(1), default=128)
    p.add_argument("--num-prompts", type=at_least(1), default=1000)
    p.add_argument("--max-concurrency", type=at_least(1), default=None, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request makes all its tokens")
    p.add_argument("--extra-body", type=json.loads, default=None,
                   help='JSON merged into every request, e.g. \'{"max_denoising_steps": 8}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true", help="write the results to a JSON file")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
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
    diffusion: dict | None = None


async def request_completion(client: httpx.AsyncClient, url: str, payload: dict, headers: dict, prompt_len: int) -> RequestOutput:
    out = RequestOutput(prompt_len=prompt_len, start_time=time.perf_counter())
    last = out.start_time
    first = True
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
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
                    now = time.perf_counter()
                    if first:
                        out.ttft, first = now - out.start_time, False
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.generated_text += choices[0].get("text") or ""
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


def make_prompts(args: argparse.Namespace) -> tuple[list, list[int]]:
    """(prompts, their token counts): token ids from the checkpoint's vocabulary when one is at hand,
    else random words (their token counts come from the server's usage)."""
    source = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    if source is not None:
        from blockdiff.model.registry import load_config

        config = load_config(source)
        special = special_token_ids(config)

        def draw(num: int, length: int, seed: int) -> list[list[int]]:
            return random_token_prompts(num, length, config.vocab_size, special, seed)

        join = list
    else:
        def draw(num: int, length: int, seed: int) -> list[list[str]]:
            rng = random.Random(seed)
            return [[rng.choice(_WORDS) for _ in range(length)] for _ in range(num)]

        join = " ".join
    if args.dataset_name == "prefix-repetition":
        sequences = prefix_repetition_prompts(draw, args.num_prompts, args.prefix_repetition_prefix_len,
                                              args.prefix_repetition_suffix_len,
                                              args.prefix_repetition_num_prefixes, args.seed)
        length = args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len
    else:
        sequences = draw(args.num_prompts, args.random_input_len, args.seed)
        length = args.random_input_len
    return [join(s) for s in sequences], [length] * args.num_prompts


def output_len(args: argparse.Namespace) -> int:
    """max_tokens of every request: the chosen dataset's output length."""
    return args.prefix_repetition_output_len if args.dataset_name == "prefix-repetition" else args.random_output_len


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process at `rate`."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


def _stats(values: list[float], percentiles: list[float]) -> dict:
    arr = np.array(values or [0.0]) * 1000
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{_pname(p)}"] = float(np.percentile(arr, p))
    return out


def _pname(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def compute_metrics(outputs: list[RequestOutput], duration: float, percentiles: list[float]) -> dict:
    ok = [o for o in outputs if o.success]
    output_lens = [o.output_tokens for o in ok]
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
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
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
        result["diffusion"] = {
            "committed_throughput": committed / duration,
            "denoising_steps_per_canvas": steps / canvases if canvases else 0.0,
            "committed_tokens_per_denoising_step": committed / steps if steps else 0.0,
            "committed_tokens": committed,
            "canvases": canvases,
            "denoising_steps": steps,
            "canvas_positions_evaluated": sum(d.get("canvas_positions_evaluated", 0) for d in reports),
        }
    return result


_TOTALS = [
    ("Benchmark duration (s):", "duration"),
    ("Total input tokens:", "total_input_tokens"),
    ("Total generated tokens:", "total_output_tokens"),
    ("Request throughput (req/s):", "request_throughput"),
    ("Output token throughput (tok/s):", "output_throughput"),
    ("Total Token throughput (tok/s):", "total_token_throughput"),
]
_DIFFUSION = [
    ("Committed throughput (tok/s):", "committed_throughput"),
    ("Denoising steps per canvas:", "denoising_steps_per_canvas"),
    ("Committed tokens per denoising step:", "committed_tokens_per_denoising_step"),
    ("Committed tokens:", "committed_tokens"),
    ("Denoising steps:", "denoising_steps"),
    ("Canvas positions evaluated:", "canvas_positions_evaluated"),
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


async def _first_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    resp = await client.get(base_url + "/v1/models", headers=headers)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def _check_reachable(client: httpx.AsyncClient, base_url: str) -> None:
    """Fail at once when nothing listens (the ready check below waits for a server that is still
    loading, not for one that was never started)."""
    try:
        await client.get(base_url + "/health", timeout=10)
    except httpx.TransportError:
        raise ConnectionError(f"cannot reach {base_url}: is blockdiff serve running?") from None


async def benchmark(args: argparse.Namespace) -> dict:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base_url + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    prompts, prompt_lens = make_prompts(args)
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0, connect=30.0), limits=limits) as client:
        await _check_reachable(client, base_url)
        model = args.model
        if model is None:
            model = await _first_model(client, base_url, headers)

        def payload(prompt) -> dict:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": output_len(args),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.ignore_eos:
                body["ignore_eos"] = True
            body.update(args.extra_body or {})
            return body

        if args.ready_check_timeout_sec > 0:
            print("Starting initial single prompt test run...")
            deadline = time.monotonic() + args.ready_check_timeout_sec
            while True:
                test = await request_completion(client, url, payload(prompts[0]), headers, prompt_lens[0])
                if test.success:
                    break
                if time.monotonic() > deadline or test.error.startswith("HTTP 4"):
                    raise ValueError(f"Initial test run failed: {test.error}")
                await asyncio.sleep(1.0)
            print("Initial test run completed.")
        print("Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        pbar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(prompts))
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        delays = arrival_delays(len(prompts), args.request_rate, args.seed)
        start = time.perf_counter()

        async def one(prompt, prompt_len: int, delay: float) -> RequestOutput:
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            if gate is None:
                out = await request_completion(client, url, payload(prompt), headers, prompt_len)
            else:
                async with gate:
                    out = await request_completion(client, url, payload(prompt), headers, prompt_len)
            if pbar is not None:
                pbar.update(1)
            return out

        outputs = await asyncio.gather(*(one(p, n, d) for p, n, d in zip(prompts, prompt_lens, delays)))
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()

    result = compute_metrics(outputs, duration, percentiles)
    print_report(result, args, selected, percentiles)
    result.update(
        date=datetime.now().strftime("%Y%m%d-%H%M%S"),
        backend="openai",
        base_url=base_url,
        model_id=model,
        dataset_name=args.dataset_name,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=args.prefix_repetition_output_len,
        request_rate=args.request_rate if args.request_rate != float("inf") else "inf",
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        seed=args.seed,
    )
    return result


def result_path(args: argparse.Namespace, result: dict) -> str:
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = os.path.basename(str(result["model_id"]).rstrip("/")) or "model"
        name = f"openai-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    return os.path.join(args.result_dir, name) if args.result_dir else name


def run(args: argparse.Namespace) -> int:
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the report
    result = asyncio.run(benchmark(args))
    if args.save_result:
        path = result_path(args, result)
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results saved to {path}")
    return 0 if result["completed"] else 1
