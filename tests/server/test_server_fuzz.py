"""schemathesis against /openapi.json of a real server: no generated request may get a 5xx.

The default run is short (a few fuzzed examples per operation); `pytest --soak` runs the form of
docs/server.md: every phase, 200 examples per operation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from server_process import ServerProcess

KEY = "fuzz-key"


def schemathesis_command(url: str, max_examples: int, phases: str | None) -> list[str]:
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", f"{url}/openapi.json",
           "-H", f"Authorization: Bearer {KEY}", "--checks", "not_a_server_error", "--max-examples", str(max_examples),
           "--request-timeout", "60", "--seed", "1", "--workers", "1"]
    return cmd + (["--phases", phases] if phases else [])


@pytest.fixture
def soak(request) -> bool:
    return request.config.getoption("--soak")


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(tiny, tmp_path, soak):
    # The queue bound turns requests for thousands of choices into a quick 429.
    server = ServerProcess(tiny, "--api-key", KEY, "--max-model-len", "64", "--max-denoising-steps", "4",
                           "--max-queued-requests", "32", log_path=str(tmp_path / "server.log"))
    try:
        cmd = schemathesis_command(server.url, 200, None) if soak else schemathesis_command(server.url, 5, "fuzzing")
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=3600 if soak else 300)
        print(r.stdout[-1500:])
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
        assert "Test cases:" in r.stdout and " passed" in r.stdout
        assert "Traceback" not in server.log(), server.log()[-4000:]
    finally:
        server.close()
