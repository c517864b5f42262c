"""What async scheduling buys the server: `blockdiff serve` on the demo model with
--async-scheduling and with --no-async-scheduling, both up at once (an idle one takes no CPU to
speak of), each engine on one thread.

    .venv/bin/python benchmarks/async_scheduling.py [--requests 48] [--concurrency 8] [--rounds 3]

Each round sends REQUESTS streamed completions of random 64-token prompts, 64 tokens each
(ignore_eos), CONCURRENCY at a time, to one server and then the other, after a warm-up of both.
Per server: output tokens per second of wall time, and the mean time between two chunks of a
stream; the ratio of the medians over the rounds. The servers' event loops stream every committed
canvas as server-sent events: the work that async scheduling moves under the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import httpx

from data_parallel import Server, _random_prompts


async def _run(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, int, list[float]]:
    """-> (seconds, output tokens, the gaps between consecutive chunks of every stream)."""
    gate = asyncio.Semaphore(concurrency)
    tokens, gaps = 0, []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        body = {"model": "demo", "prompt": prompts[i], "max_tokens": max_tokens, "ignore_eos": True, "seed": i,
                "stream": True, "stream_options": {"include_usage": True}}
        async with gate, client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            last = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens += chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
        return time.perf_counter() - t0, tokens, gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    warmup, prompts = _random_prompts(args.concurrency, 64, rng), _random_prompts(args.requests, 64, rng)
    names = ("async", "sync")
    servers = {"async": Server("--async-scheduling"), "sync": Server("--no-async-scheduling")}
    rates: dict[str, list[float]] = {n: [] for n in names}
    chunk_gaps: dict[str, list[float]] = {n: [] for n in names}
    try:
        for server in servers.values():
            asyncio.run(_run(server.url, warmup, 64, args.concurrency))
        for r in range(args.rounds):
            for name in names:
                seconds, tokens, gaps = asyncio.run(_run(servers[name].url, prompts, 64, args.concurrency))
                rates[name].append(tokens / seconds)
                chunk_gaps[name].append(statistics.mean(gaps))
                print(f"  round {r + 1}, {name:5s}: {args.requests} requests in {seconds:5.1f} s, "
                      f"{tokens / seconds:6.1f} output tok/s, {1e3 * statistics.mean(gaps):6.1f} ms between chunks "
                      f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for server in servers.values():
            server.close()
    on, off = statistics.median(rates["async"]), statistics.median(rates["sync"])
    gap_on, gap_off = statistics.median(chunk_gaps["async"]), statistics.median(chunk_gaps["sync"])
    print(f"  median: async {on:.1f}, sync {off:.1f} output tok/s: x{on / off:.3f}; between chunks "
          f"{1e3 * gap_on:.1f} against {1e3 * gap_off:.1f} ms")


if __name__ == "__main__":
    main()
