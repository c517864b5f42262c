"""The EngineClient seam (engine/client.py) as AsyncEngine implements it for one local engine:
limits, statistics, resolving once, cost, typed errors, adding and aborting."""

from __future__ import annotations

import asyncio

import pytest

from blockdiff import SamplingParams
from blockdiff.config import EngineConfig
from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.engine.client import EngineClient, EngineStats
from blockdiff.engine.engine import LLMEngine
from blockdiff.engine.input_processor import InputProcessor
from blockdiff.inputs import EngineRequest, PromptInputs
from blockdiff.sampling_params import InvalidParam, ResolvedParams

PROMPT = [5, 6, 7, 9]
PARAMS = SamplingParams(max_tokens=12, max_denoising_steps=3, seed=4, ignore_eos=True)


@pytest.fixture
def client(tiny):
    return AsyncEngine(LLMEngine(EngineConfig(tiny, max_model_len=64, max_num_seqs=2)))


async def _finals(stream) -> list:
    return [out async for _, out in stream if out.finished]


def test_limits_tokenizer_and_sampler(client):
    assert isinstance(client, EngineClient)
    engine = client.engine
    limits = client.limits
    assert (limits.max_model_len, limits.max_num_seqs, limits.canvas_length, limits.vocab_size) == (64, 2, 8, 301)
    assert limits.max_denoising_steps == engine.max_denoising_steps and limits.model == engine.cfg.model
    assert client.tokenizer is engine.tokenizer and client.sampler.name == "entropy_bound"
    client.shutdown()


def test_resolved_once_and_taken_as_they_are(client, monkeypatch):
    """A request added with the parameters the client resolved is not resolved again: the engine's
    request holds that very object, and the resolver ran once; an EngineRequest made from unresolved
    parameters (`request`) resolves them once. Both give the same tokens."""
    calls = []
    real = InputProcessor.resolve
    monkeypatch.setattr(InputProcessor, "resolve", lambda self, *a: calls.append(a) or real(self, *a))

    async def main():
        client.start()
        resolved = client.resolve(PARAMS, len(PROMPT))
        assert isinstance(resolved, ResolvedParams) and resolved.prompt_len == len(PROMPT)
        assert resolved.max_tokens == 12 and resolved.entropy_bound == 0.1  # defaults merged
        assert client.cost(resolved) == 2 * 8 * 3  # canvases x canvas length x steps
        stream = await client.add([EngineRequest(PromptInputs(PROMPT), resolved)])
        (rid,) = stream.request_ids
        assert client.engine.requests[rid].params is resolved
        once = await _finals(stream)
        assert len(calls) == 1
        again = await _finals(await client.add([client.inputs.request(PROMPT, PARAMS)]))
        assert len(calls) == 2
        assert once[0].token_ids == again[0].token_ids and len(once[0].token_ids) == 12
        await client.stop()

    asyncio.run(main())


def test_resolved_for_another_prompt_is_refused(client):
    async def main():
        client.start()
        resolved = client.resolve(PARAMS, 3)
        with pytest.raises(ValueError, match="resolved for a prompt of 3 tokens"):
            await client.add([EngineRequest(PromptInputs(PROMPT), resolved)])
        await client.stop()

    asyncio.run(main())


def test_bad_parameters_raise_a_typed_error_naming_the_field(client):
    async def main():
        client.start()
        with pytest.raises(InvalidParam) as e:
            await client.add([client.inputs.request(PROMPT, SamplingParams(max_tokens=10**6))])
        assert e.value.field == "max_tokens" and str(e.value).startswith("max_tokens (1000000) + prompt")
        with pytest.raises(InvalidParam) as e:
            client.resolve(SamplingParams(max_denoising_steps=10**6), len(PROMPT))
        assert e.value.field == "max_denoising_steps"
        with pytest.raises(InvalidParam) as e:
            await client.add([client.inputs.request([1, 2, 999], PARAMS)])
        assert e.value.field == "prompt"
        assert client.stats().num_waiting == 0 and not client.engine.requests  # nothing was added
        await client.stop()

    asyncio.run(main())


def test_stats_while_requests_run_and_abort(client):
    async def main():
        client.start()
        idle = client.stats()
        assert isinstance(idle, EngineStats)
        assert (idle.num_running, idle.num_waiting, idle.num_free_slots, idle.kv_cache_usage) == (0, 0, 2, 0)
        assert idle.kv_cache_blocks == client.engine.kv.full.num_blocks and idle.num_preemptions == 0
        long = SamplingParams(max_tokens=64 - len(PROMPT), max_denoising_steps=8, ignore_eos=True)
        streams = [await client.add([client.inputs.request(PROMPT, long)]) for _ in range(3)]
        await anext(streams[0])  # the first committed canvas: two run, one waits
        busy = client.stats()
        assert (busy.num_running, busy.num_waiting, busy.num_free_slots) == (2, 1, 0) and busy.kv_cache_usage > 0
        assert busy.prefix_cache_queries >= len(PROMPT)
        client.abort([rid for s in streams for rid in s.request_ids])
        while client.stats().num_running or client.stats().num_waiting:
            await asyncio.sleep(0.01)
        assert client.stats().num_free_slots == 2 and not client.engine.requests
        await client.stop()

    asyncio.run(main())
