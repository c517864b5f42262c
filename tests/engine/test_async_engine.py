"""AsyncEngine in-process, on a real LLMEngine over the tiny checkpoint: what happens to requests
when a step fails."""

from __future__ import annotations

import asyncio
import threading

import pytest

from blockdiff import SamplingParams
from blockdiff.engine.async_engine import AsyncEngine, RequestFailed
from blockdiff.config import EngineConfig
from blockdiff.engine.engine import LLMEngine

PARAMS = SamplingParams(max_tokens=8, max_denoising_steps=2, seed=0)


@pytest.fixture
def engine(tiny):
    return LLMEngine(EngineConfig(tiny, max_model_len=64, max_num_seqs=2))


def _fail_next_step(engine: LLMEngine, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """The next step blocks until `release` is set, then raises (a fault injected into the real
    executor, once); `running` is set once it blocks."""
    running, release = threading.Event(), threading.Event()
    real = engine.executor.execute

    def execute(plan):
        monkeypatch.setattr(engine.executor, "execute", real)
        running.set()
        release.wait(30)
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.executor, "execute", execute)
    return running, release


def test_failed_step_fails_its_requests_and_serving_goes_on(engine, monkeypatch):
    """The requests of a step that raises end with RequestFailed; one that arrived meanwhile, and
    every later one, is served: one bad step no longer disables the engine."""
    running, release = _fail_next_step(engine, monkeypatch)

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        stream = await async_engine.add([async_engine.inputs.request([5, 6, 7], PARAMS)])
        await asyncio.get_running_loop().run_in_executor(None, running.wait, 30)
        late = asyncio.ensure_future(async_engine.add([async_engine.inputs.request([8, 9], PARAMS)]))
        await asyncio.sleep(0.05)  # `late` is now queued behind the step
        release.set()
        with pytest.raises(RequestFailed, match="boom"):
            await asyncio.wait_for(anext(stream), 10)
        late_stream = await asyncio.wait_for(late, 10)
        finals = [out async for _, out in late_stream if out.finished]
        assert [o.finish_reason for o in finals] == ["length"] and len(finals[0].token_ids) == 8
        assert async_engine.available
        again = await async_engine.add([async_engine.inputs.request([5, 6, 7], PARAMS)])
        assert [out.finish_reason async for _, out in again if out.finished] == ["length"]
        await async_engine.stop()
        assert not engine.requests and engine.num_waiting == engine.num_running == 0
        assert engine.kv.full.used == 0 and sorted(engine.scheduler.free_slots) == [0, 1]

    asyncio.run(main())


def test_abort_frees_running_and_waiting_requests(engine):
    """An API call's abort releases its admitted requests (slot, cache) and its waiting ones."""

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        long = SamplingParams(max_tokens=48, max_denoising_steps=48, seed=0)  # the tiny model's steps limit
        stream = await async_engine.add([async_engine.inputs.request([5, 6, 7 + i], long) for i in range(6)])
        while engine.num_running < 2:
            await asyncio.sleep(0.01)
        assert engine.num_waiting == 4 and engine.kv_cache_usage > 0
        stream.abort()
        for _ in range(500):  # the loop applies the aborts between two steps
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        assert not engine.requests and not engine.scheduler.waiting and not engine.scheduler.running
        assert engine.kv.full.used == 0 and sorted(engine.scheduler.free_slots) == [0, 1]
        await async_engine.stop()

    asyncio.run(main())
