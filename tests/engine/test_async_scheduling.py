"""Scheduling overlapped with execution: with async scheduling the engine starts
step n+1 as soon as step n's results are applied and makes step n's outputs while n+1 runs, so the
caller's own work between two `step()` calls (delivering outputs, adding and aborting requests)
happens while the model computes. Outputs are the same with and without it, and a request aborted
while its step is in flight takes nothing from that step and gives back all it held."""

from __future__ import annotations

import time

import pytest

from blockdiff import LLM, SamplingParams
from blockdiff.engine.engine import LLMEngine
from blockdiff.config import EngineConfig

PROMPTS = [[5, 6, 7], [9] * 13, [3, 4] * 4, [11, 12]]


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=12 + 4 * i, max_denoising_steps=3 + i, seed=i, ignore_eos=True,
                           logprobs=0 if i == 1 else None, stream_drafts=i == 2) for i in range(len(PROMPTS))]


def _executions(engine: LLMEngine) -> list[tuple[float, float]]:
    """(start, end) of every plan the executor runs, appended as they end."""
    spans, execute = [], engine.executor.execute

    def timed(plan):
        t = time.perf_counter()
        try:
            return execute(plan)
        finally:
            spans.append((t, time.perf_counter()))

    engine.executor.execute = timed
    return spans


def _drive(engine: LLMEngine, pause: float = 0.0) -> tuple[dict, list[tuple[float, float]]]:
    """Step until done, pausing `pause` seconds after each step (the caller's own work); -> the
    final outputs by request id, and the (return of a step, next call) intervals."""
    finals, gaps = {}, []
    while engine.has_unfinished():
        outs = engine.step()
        back = time.perf_counter()
        for out in outs:
            if out.finished:
                finals[out.request_id] = (out.token_ids, [lp.logprob for lp in out.outputs[0].token_logprobs or ()],
                                          out.metrics["canvases"], out.metrics["denoising_steps"])
        time.sleep(pause)
        gaps.append((back, time.perf_counter()))
    return finals, gaps


def _engine(tiny: str, on: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(tiny, async_scheduling=on, max_num_seqs=4, **kw))


@pytest.mark.parametrize("k", [1, 3])
def test_outputs_are_the_same_with_and_without_async_scheduling(tiny, k):
    runs = {}
    for on in (False, True):
        engine = _engine(tiny, on, num_scheduler_steps=k)
        try:
            for p, sp in zip(PROMPTS, _params()):
                engine.add_request(p, sp)
            runs[on], _ = _drive(engine)
        finally:
            engine.shutdown()
    assert len(runs[False]) == len(PROMPTS)
    assert runs[True] == runs[False]


def test_the_next_step_computes_while_the_caller_handles_the_outputs(tiny):
    """The caller spends 30 ms after each step; with async scheduling the next step runs inside that
    time, without it the model waits for the caller (the test fails on an engine without the overlap)."""
    overlapped = {}
    for on in (False, True):
        engine = _engine(tiny, on)
        try:
            spans = _executions(engine)
            for p, sp in zip(PROMPTS, _params()):
                engine.add_request(p, sp)
            _, gaps = _drive(engine, pause=0.03)
        finally:
            engine.shutdown()
        # executions that ran while the caller had its outputs, before it called step() again
        overlapped[on] = sum(any(s < later and e > back for back, later in gaps) for s, e in spans)
        assert len(spans) > 8
    assert overlapped[False] == 0
    assert overlapped[True] >= len(spans) // 2, overlapped


def test_a_request_aborted_while_its_step_runs_leaves_nothing_behind(tiny):
    """Aborted between two steps, while the step that runs it is in flight: the others' outputs are
    those they have alone, and every slot and block comes back."""
    engine = _engine(tiny, True)
    try:
        params = _params()
        alone = {}
        for i in (0, 2, 3):
            engine.add_request(PROMPTS[i], params[i], f"alone-{i}")
            alone[i] = _drive(engine)[0][f"alone-{i}"]
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            engine.add_request(p, sp, f"r{i}")
        finals, aborted = {}, False
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = (out.token_ids, [lp.logprob for lp in out.outputs[0].token_logprobs or ()],
                                              out.metrics["canvases"], out.metrics["denoising_steps"])
            victim = engine.requests.get("r1")
            if not aborted and victim is not None and victim.metrics.canvases >= 1 and engine._in_flight is not None:
                assert victim in engine._in_flight[0].decoder or any(r is victim for r, _ in engine._in_flight[0].encoder)
                engine.abort("r1")
                aborted = True
        assert aborted
        assert "r1" not in finals
        assert {i: finals[f"r{i}"] for i in (0, 2, 3)} == alone
        assert engine.num_free_slots == 4 and engine.num_running == 0
        # cached prefixes may stay, unreferenced: free blocks still
        assert engine.kv_cache_usage == 0.0 and engine.kv.full.num_free == engine.kv.full.num_blocks
    finally:
        engine.shutdown()


def test_a_failing_step_in_flight_ends_only_its_requests(tiny):
    """A step that raises on the step thread ends the requests it ran with an error at the next
    `step()`, and the engine goes on with a request added afterwards."""
    engine = _engine(tiny, True)
    try:
        execute, calls = engine.executor.execute, [0]

        def flaky(plan):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("boom")
            return execute(plan)

        engine.executor.execute = flaky
        engine.add_request(PROMPTS[0], _params()[0], "a")
        errors = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    errors.append((out.request_id, out.error))
        assert errors == [("a", "the engine step failed: RuntimeError: boom")]
        engine.add_request(PROMPTS[3], _params()[3], "b")
        done, _ = _drive(engine)
        assert len(done["b"][0]) == _params()[3].max_tokens
    finally:
        engine.shutdown()


def test_the_llm_api_the_flag_and_the_default(tiny):
    """`LLM(async_scheduling=...)` and `--async-scheduling` / `--no-async-scheduling` (vLLM's name);
    unset, the device's default: off on the CPU (docs/benchmarks.md), on for CUDA."""
    import argparse

    from blockdiff.arg_utils import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--model", tiny]))
    assert cfg.async_scheduling is None and not cfg.overlaps_steps("cpu") and cfg.overlaps_steps("cuda:1")
    assert engine_config(p.parse_args(["--model", tiny, "--async-scheduling"])).overlaps_steps("cpu")
    assert not engine_config(p.parse_args(["--model", tiny, "--no-async-scheduling"])).overlaps_steps("cuda")
    with LLM(tiny) as llm:
        assert not llm.engine.async_scheduling
        off = llm.generate(PROMPTS, _params(), use_tqdm=False)
    with LLM(tiny, async_scheduling=True) as llm:
        assert llm.engine.async_scheduling
        on = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


@pytest.mark.slow  # two servers: ~20 s on 2 cores
def test_the_server_with_async_scheduling(tiny, tmp_path):
    """`blockdiff serve --async-scheduling` and the openai client: 12 requests at once (streamed or
    not, chat or not, stop strings) on 6 slots and a small KV cache, each exactly as alone; a client
    that hangs up mid-stream leaves nothing running and the cache empty."""
    import asyncio

    import httpx
    import openai

    from server_process import ServerProcess

    from blockdiff.model.loader import load_model
    from blockdiff.worker.kv_cache import cache_bytes_per_block, sliding_blocks_needed, sliding_bytes_per_block

    model = load_model(tiny)  # 8 full blocks of 16 tokens
    sliding = sliding_blocks_needed(model.config.window_past(256), model.config.canvas_length, 16, 6,
                                    EngineConfig.max_prefill_tokens)
    memory = sliding_bytes_per_block(model, 16) * sliding + cache_bytes_per_block(model, 16) * 8
    server = ServerProcess(tiny, "--async-scheduling", "--max-num-seqs", "6", "--max-model-len", "256",
                           "--kv-cache-memory", str(memory), "--max-denoising-steps", "4",
                           log_path=str(tmp_path / "server.log"))
    texts = ["Hello", "The quick brown fox", "Numbers such as 1 2 3", "Block diffusion"]

    async def one(client, i: int):
        kw = dict(model=tiny, max_tokens=8 + (5 * i) % 23, seed=i, stop=["e"] if i % 4 == 0 else None,
                  stream=i % 2 == 1, extra_body={"return_token_ids": True})
        chat = i % 3 == 2
        api = client.chat.completions if chat else client.completions
        args = {"messages": [{"role": "user", "content": texts[i % 4]}]} if chat else {"prompt": texts[i % 4]}
        r = await api.create(**args, **kw)
        chunks = [c async for c in r] if kw["stream"] else [r]
        text, ids = "", []
        for c in chunks:
            for choice in c.choices:
                if not chat:
                    text += choice.text or ""
                else:
                    text += (choice.delta.content if kw["stream"] else choice.message.content) or ""
                ids += choice.token_ids or []
        return text, ids

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            alone = [await one(client, i) for i in range(12)]
            together = await asyncio.gather(*(one(client, i) for i in range(12)))
        return alone, together

    try:
        alone, together = asyncio.run(main())
        assert all(ids for _, ids in alone) and list(together) == alone
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "model": tiny, "prompt": "Hello", "max_tokens": 96, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        m = server.wait_idle()
        assert m.total("vllm:num_requests_running") == 0 and m.total("vllm:kv_cache_usage_perc") == 0
    finally:
        server.close()
