"""The server under load: 64 clients for a minute, mixed completions and chat, streamed and not,
every request seeded, against the demo server with its default limits and 8 slots. Nothing may be lost, every
output must equal the same request run alone, /health must keep answering, and RSS must stay
flat. `pytest -s -m slow tests/server/test_server_load.py` prints what it measured (docs/server.md,
"Limits")."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import openai
import pytest
from server_process import ServerProcess, rss_mib

CLIENTS = 64
SECONDS = 60
TEXTS = ["sort: 9 4 7", "reverse: diffusion", "upper: canvas", "sort: 3 1 2 8", "reverse: block", "upper: tokens"]


def _case(i: int) -> dict:
    """Case i of 48: endpoint, streaming, length, steps and seed all vary with i."""
    return {"chat": i % 2 == 0, "stream": i % 3 == 0, "text": TEXTS[i % len(TEXTS)], "seed": 1000 + i,
            "max_tokens": 8 * (1 + i % 8), "steps": 8 if i % 5 else 16}


CASES = [_case(i) for i in range(48)]


async def _run(client: openai.AsyncOpenAI, case: dict) -> tuple[list[int], str]:
    kw = dict(model="demo", max_tokens=case["max_tokens"], seed=case["seed"], stream=case["stream"],
              extra_body={"max_denoising_steps": case["steps"], "return_token_ids": True})
    if case["chat"]:
        r = await client.chat.completions.create(messages=[{"role": "user", "content": case["text"]}], **kw)
    else:
        r = await client.completions.create(prompt=case["text"], **kw)
    chunks = [c async for c in r] if case["stream"] else [r]
    ids, reason = [], None
    for c in chunks:
        for choice in c.choices:
            ids += choice.token_ids or []
            reason = choice.finish_reason or reason
    return ids, reason


@pytest.mark.slow
def test_64_clients_for_a_minute_lose_nothing_and_equal_their_solo_runs(tmp_path):
    # 8 slots for 64 clients: requests wait, and those that had their share are preempted for them.
    server = ServerProcess(None, "--max-num-seqs", "8", log_path=str(tmp_path / "server.log"))
    try:
        async def main():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                          timeout=600) as client:
                solo = [await _run(client, case) for case in CASES]
                rss_before = rss_mib(server.proc.pid)
                results, health, stop = [], [], time.monotonic() + SECONDS

                async def one_client(k: int):
                    i = k
                    while time.monotonic() < stop:
                        case = i % len(CASES)
                        results.append((case, await _run(client, CASES[case])))
                        i += CLIENTS

                async def probe():
                    async with httpx.AsyncClient(timeout=60) as h:
                        while time.monotonic() < stop:
                            t0 = time.perf_counter()
                            assert (await h.get(server.url + "/health")).status_code == 200
                            health.append(time.perf_counter() - t0)
                            await asyncio.sleep(0.05)

                t0 = time.monotonic()
                await asyncio.gather(probe(), *(one_client(k) for k in range(CLIENTS)))
                return solo, results, health, rss_before, time.monotonic() - t0

        solo, results, health, rss_before, seconds = asyncio.run(main())
        m = server.wait_idle(60)
        rss_after = rss_mib(server.proc.pid)
        differ = [case for case, got in results if got != solo[case]]
        print(f"{len(results)} requests from {CLIENTS} clients in {seconds:.0f} s; {len(differ)} differ from their solo "
              f"run; {m.total('vllm:num_preemptions_total'):.0f} preemptions; /health p50 "
              f"{statistics.median(health) * 1e3:.1f} ms, max {max(health) * 1e3:.0f} ms over {len(health)} probes; "
              f"RSS {rss_before:.0f} -> {rss_after:.0f} MiB")
        assert all(reason in ("stop", "length") for _, (_, reason) in results)
        assert m['blockdiff:http_responses_total{status="200"}'] >= len(results) + len(solo)
        assert not [k for k in m if k.startswith("blockdiff:http_responses_total") and not k.endswith('"200"}')], m
        assert not differ, differ[:10]
        assert rss_after - rss_before < 200
    finally:
        server.close()
