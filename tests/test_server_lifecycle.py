"""Server lifecycle: SIGTERM with a request in flight ends that request cleanly and stops the whole
process group (server and any tensor-parallel workers) within seconds."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import ServerProcess

@pytest.mark.parametrize("tp", [1, 2])
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
