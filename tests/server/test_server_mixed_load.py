"""The server under a mixed load: 64 clients for 45 s on the demo model with a LoRA adapter, mixing
the adapter and the base model, chat and completions, Anthropic's Messages API with a tool, structured
output, and streams that the client drops after their first chunk. Every finished request is seeded
and must equal the same request run alone; nothing may be lost (every response is a 200 with a
finish reason), and /health keeps answering (HealthProbe). `pytest -s -m slow tests/server/test_server_mixed_load.py`
prints what it measured."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import openai
import pytest
from helpers import import_test_file
from server_process import HealthProbe, ServerProcess

from blockdiff.demo.tasks import WEATHER_TOOL
from blockdiff.hub import DEMO_CHECKPOINT

_lora = import_test_file("model/test_lora.py")
CLIENTS = 64
SECONDS = 45
TEXTS = ["sort: 9 4 7", "reverse: diffusion", "upper: canvas", "sort: 3 1 2 8", "weather in Paris"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"],
          "additionalProperties": False}
KINDS = ("chat", "lora", "completion", "messages", "structured", "dropped")


def _case(i: int) -> dict:
    return {"kind": KINDS[i % len(KINDS)], "stream": i % 4 == 1, "text": TEXTS[i % len(TEXTS)], "seed": 500 + i,
            "max_tokens": 8 * (1 + i % 4)}


CASES = [_case(i) for i in range(36)]


async def _run(oa: openai.AsyncOpenAI, an: anthropic.AsyncAnthropic, case: dict):
    """-> what the request gave (None for a dropped stream)."""
    kind, seed, text = case["kind"], case["seed"], case["text"]
    extra = {"seed": seed, "max_denoising_steps": 8}
    if kind == "messages":
        r = await an.messages.create(model="demo", max_tokens=case["max_tokens"] + 16, tools=[{
            "name": WEATHER_TOOL["function"]["name"], "description": WEATHER_TOOL["function"]["description"],
            "input_schema": WEATHER_TOOL["function"]["parameters"]}], messages=[{"role": "user", "content": text}],
            extra_body=extra)
        # tool_use ids are drawn per response: the rest of each block is compared
        return r.stop_reason, [b.model_dump(exclude={"id"}) for b in r.content]
    messages = [{"role": "user", "content": text}]
    if kind == "dropped":
        stream = await oa.chat.completions.create(model="demo", messages=messages, max_tokens=64, stream=True,
                                                  extra_body=extra)
        async for _ in stream:
            break
        await stream.close()
        return None
    if kind == "completion":
        r = await oa.completions.create(model="demo", prompt=text, max_tokens=case["max_tokens"], seed=seed,
                                        stream=case["stream"], extra_body={"max_denoising_steps": 8})
        chunks = [c async for c in r] if case["stream"] else [r]
        chunks = [c for c in chunks if c.choices]
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    structured = kind == "structured"
    stream = case["stream"] and not structured
    kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}} if structured else {}
    r = await oa.chat.completions.create(model="demo-lora" if kind == "lora" else "demo", messages=messages,
                                         max_tokens=case["max_tokens"] + (16 if structured else 0), seed=seed,
                                         stream=stream, extra_body={"max_denoising_steps": 8}, **kw)
    if not stream:
        if structured:
            json.loads(r.choices[0].message.content)  # the constraint held
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = [c async for c in r if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.slow
def test_64_clients_mixing_lora_messages_tools_structured_and_dropped_streams(tmp_path):
    adapter = _lora.make_adapter(str(DEMO_CHECKPOINT), str(tmp_path / "adapter"), seed=7, r=4)
    server = ServerProcess(None, "--max-num-seqs", "8", "--max-model-len", "512", "--enable-lora",
                           "--lora-modules", f"demo-lora={adapter}", log_path=str(tmp_path / "server.log"))
    try:
        async def main():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600) as oa, \
                    anthropic.AsyncAnthropic(base_url=server.url, api_key="none", max_retries=0, timeout=600) as an:
                solo = [await _run(oa, an, case) for case in CASES]
                results, stop = [], time.monotonic() + SECONDS

                async def one_client(k: int):
                    i = k
                    while time.monotonic() < stop:
                        case = i % len(CASES)
                        results.append((case, await _run(oa, an, CASES[case])))
                        i += CLIENTS

                await asyncio.gather(*(one_client(k) for k in range(CLIENTS)))
                return solo, results

        with HealthProbe(server) as health:
            solo, results = asyncio.run(main())
        m = server.wait_idle(60)
        differ = [(CASES[case]["kind"], case, got, solo[case]) for case, got in results if got != solo[case]]
        kinds = {kind: sum(CASES[c]["kind"] == kind for c, _ in results) for kind in KINDS}
        print(f"{len(results)} requests from {CLIENTS} clients ({kinds}); {len(differ)} differ from their solo run "
              f"({ {kind: sum(d[0] == kind for d in differ) for kind in KINDS} }); "
              f"/health idle {health.idle * 1e3:.1f} ms, worst {health.worst * 1e3:.0f} ms")
        assert all(kinds.values()), kinds
        health.check()
        assert not differ, [(d[0], CASES[d[1]], d[2], d[3]) for d in differ[:8]]
        assert not [k for k in m if k.startswith("blockdiff:http_responses_total") and not k.endswith('"200"}')], m
    finally:
        server.close()
