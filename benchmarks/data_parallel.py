"""Data-parallel replicas on this machine: throughput at 1 and 2 replicas, and the prefix
cache's hit rate with the front end's affinity routing against round robin.

    .venv/bin/python benchmarks/data_parallel.py

1. Throughput. `blockdiff serve` on the demo model with --data-parallel-size 1 and 2, each engine
   on one thread (OMP_NUM_THREADS=1), both servers up (an idle one takes no CPU to speak of):
   REQUESTS completions of random 64-token prompts, 64 tokens each (ignore_eos), CONCURRENCY at a
   time, after a warm-up; ROUNDS rounds alternating the two. Output tokens per second of wall time;
   the ratio of the medians. The front end's own work (HTTP, JSON, routing) takes CPU too, beside
   the replicas.
2. Prefix hit rate. DOCS documents of DOC_TOKENS tokens, each asked QUESTIONS times with a suffix
   of its own, in a random order, 4 at a time, to two replicas whose KV caches hold CACHE_BLOCKS
   full blocks each (about 60% of the documents), so that where a document goes decides whether its
   blocks are still cached: (a) one `serve -dp 2` front end, which routes by the replicas' KV
   events; (b) round robin over two servers of one replica each (`--data-parallel-size 2
   --data-parallel-rank r`, what a plain load balancer in front of external replicas does). Hit
   rate: prompt tokens found cached over prompt tokens looked up (the replicas' prefix_cache
   counters in /metrics).
Every run starts its servers anew; both parts run back to back on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from blockdiff.hub import resolve_model
from blockdiff.model.loader import load_model
from blockdiff.worker.kv_cache import cache_bytes_per_block, sliding_blocks_needed, sliding_bytes_per_block

MAX_NUM_SEQS = 8
DOCS, DOC_TOKENS, QUESTIONS, CACHE_BLOCKS = 16, 256, 6, 192
_SAMPLE = re.compile(r'^(\w+:?\w*)\{[^}]*engine="(\d+)"[^}]*\} (\S+)$')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "blockdiff", "serve", "--port", str(self.port),
                                      "--max-num-seqs", str(MAX_NUM_SEQS), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited:\n{self.log.read().decode()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("server not ready")
            time.sleep(0.2)

    def counters(self) -> dict[str, float]:
        """The replicas' prefix-cache counters, added up."""
        out = {"queries": 0.0, "hits": 0.0}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = _SAMPLE.match(line)
            if m and m.group(1) in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                out["queries" if "queries" in m.group(1) else "hits"] += float(m.group(3))
        return out

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def _run(urls: list[str], prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[float, int]:
    """Send the prompts, request i to urls[i % len(urls)]; -> (seconds, output tokens)."""
    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal tokens
        async with gate:
            r = await client.post(urls[i % len(urls)] + "/v1/completions", json={
                "model": "demo", "prompt": prompts[i], "max_tokens": max_tokens, "ignore_eos": True, "seed": i})
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
        return time.perf_counter() - t0, tokens


def _random_prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10, 100) for _ in range(length)] for _ in range(n)]


def throughput(requests: int, concurrency: int, rounds: int) -> None:
    rng = random.Random(0)
    warmup, prompts = _random_prompts(concurrency, 64, rng), _random_prompts(requests, 64, rng)
    servers = {replicas: Server("--data-parallel-size", str(replicas)) for replicas in (1, 2)}
    rates: dict[int, list[float]] = {1: [], 2: []}
    try:
        for server in servers.values():
            asyncio.run(_run([server.url], warmup, 64, concurrency))
        for r in range(rounds):
            for replicas, server in servers.items():
                seconds, tokens = asyncio.run(_run([server.url], prompts, 64, concurrency))
                rates[replicas].append(tokens / seconds)
                print(f"  round {r + 1}, {replicas} replica{'s' if replicas > 1 else ' '}: {requests} requests in "
                      f"{seconds:5.1f} s, {tokens / seconds:6.1f} output tok/s (load average {os.getloadavg()[0]:.1f})",
                      flush=True)
    finally:
        for server in servers.values():
            server.close()
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"  median: 1 replica {one:.1f}, 2 replicas {two:.1f} output tok/s: x{two / one:.2f}")


def hit_rate() -> None:
    model = load_model(resolve_model(None, None))
    sliding = sliding_blocks_needed(model.config.window_past(1024), model.config.canvas_length, 16, MAX_NUM_SEQS, 2048)
    memory = sliding_bytes_per_block(model, 16) * sliding + cache_bytes_per_block(model, 16) * CACHE_BLOCKS
    rng = random.Random(1)
    docs = _random_prompts(DOCS, DOC_TOKENS, rng)
    order = [d for d in range(DOCS) for _ in range(QUESTIONS)]
    rng.shuffle(order)
    prompts = [docs[d] + [rng.randrange(10, 100) for _ in range(8)] for d in order]
    cache = ("--kv-cache-memory", str(memory))
    rows = []
    for name in ("affinity (-dp 2 front end)", "round robin (2 servers)"):
        if name.startswith("affinity"):
            servers = [Server("--data-parallel-size", "2", *cache)]
        else:
            servers = [Server("--data-parallel-size", "2", "--data-parallel-rank", str(r), *cache) for r in range(2)]
        try:
            seconds, _ = asyncio.run(_run([s.url for s in servers], prompts, 8, 4))
            counts = [s.counters() for s in servers]
        finally:
            for s in servers:
                s.close()
        queries, hits = sum(c["queries"] for c in counts), sum(c["hits"] for c in counts)
        rows.append((name, hits / queries, queries - hits, seconds))
        print(f"  {name:28s} hit rate {hits / queries:6.1%}, {queries - hits:7.0f} prompt tokens prefilled, "
              f"{len(prompts) / seconds:5.2f} req/s", flush=True)
    print(f"  affinity / round robin: x{rows[0][1] / rows[1][1]:.2f} hit rate, "
          f"x{rows[1][2] / rows[0][2]:.2f} fewer prompt tokens prefilled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"throughput (demo model, OMP_NUM_THREADS=1 per engine, {os.cpu_count()} cores):")
    throughput(args.requests, args.concurrency, args.rounds)
    print(f"prefix hit rate ({DOCS} documents x {QUESTIONS} questions of {DOC_TOKENS} + 8 tokens, "
          f"{CACHE_BLOCKS} KV blocks of 16 tokens per replica):")
    hit_rate()


if __name__ == "__main__":
    main()
