"""Server lifecycle: SIGTERM with a request in flight ends that request cleanly and stops the whole
process group (server and any tensor-parallel workers) within seconds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import httpx
import pytest
from server_process import ServerProcess, free_port

from blockdiff.config import EngineConfig
from blockdiff.engine.engine import LLMEngine
from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.entrypoints.openai.server import ServerConfig, build_app

# two ranks: 12 s on a quiet 2-core AVX2 machine
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sigterm_stops_the_server(tiny, tmp_path, tp):
    server = ServerProcess(tiny, "--tensor-parallel-size", str(tp), "--max-model-len", "2048",
                           log_path=str(tmp_path / "server.log"))
    try:
        body = {"prompt": "Hello", "max_tokens": 2000, "ignore_eos": True, "max_denoising_steps": 16, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None  # still generating
            seconds = server.terminate()
            # The open stream was ended by the server, not cut: an error event, then [DONE].
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        assert seconds < 10, server.log()
        assert not server.group_alive(), "a process of the server is still running"
        log = server.log()
        assert "engine shut down" in log
        assert "Traceback" not in log, log
    finally:
        server.close()


def test_invalid_sampler_flags_fail_startup(tiny):
    """--t-min above the checkpoint's t_max would make every request a 400: the server refuses to start."""
    cmd = [sys.executable, "-m", "blockdiff", "serve", tiny, "--port", str(free_port()), "--t-min", "0.95"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert "error: invalid sampler flags" in r.stderr and "t_min=0.95" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_failed_step_fails_its_request_and_serving_goes_on(tiny, monkeypatch):
    """In-process (no subprocess can make a real step fail): a step that raises ends its request with
    500 request_failed; /health stays 200 and the next request is served."""
    engine = LLMEngine(EngineConfig(tiny, max_model_len=64))
    stepping = threading.Event()
    real = engine.executor.execute

    def execute(plan):  # a fault injected into the real executor, once
        monkeypatch.setattr(engine.executor, "execute", real)
        stepping.set()
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.executor, "execute", execute)
    app = build_app(AsyncEngine(engine), ServerConfig(["tiny"]))
    body = {"prompt": [5, 6, 7], "max_tokens": 8}

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 500, r.text
                assert r.json()["error"] == {"message": "the engine step failed: RuntimeError: boom", "type": "server_error",
                                             "param": None, "code": "request_failed"}
                assert (await client.get("/health")).status_code == 200
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert stepping.is_set()

    asyncio.run(main())
