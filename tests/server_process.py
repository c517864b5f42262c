"""A real `blockdiff serve` subprocess on a free port, for the server tests."""

from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; fails on any line that is not a comment or a sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        out[m.group(1)] = float(m.group(2))
    return out


def _limit_files(n: int) -> None:
    """In the child before exec: `ulimit -n n`."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


class ServerProcess:
    """`python -m blockdiff serve [MODEL] ARGS...` (no MODEL: the bundled demo) in its own session (so every process it starts can be
    found by its process group), ready once /health answers 200."""

    def __init__(self, model: str | None, *args: str, log_path: str, ready_timeout: float = 180.0,
                 max_open_files: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # With --api-key, everything but /health needs it, /metrics included.
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        env = {k: v for k, v in os.environ.items() if k != "BLOCKDIFF_API_KEY"}
        # Tiny models gain nothing from a second thread, and on a shared 2-core machine two OpenMP
        # threads stall each other whenever the test process or anything else takes a core.
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "blockdiff", "serve", *([model] if model else []), "--port", str(self.port), *args]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                     preexec_fn=None if max_open_files is None else lambda: _limit_files(max_open_files))
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        return parse_metrics(r.text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and the KV cache is empty; -> the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["blockdiff_requests_running"] == 0 and m["blockdiff_requests_waiting"] == 0
            if (idle and m["blockdiff_kv_cache_usage_ratio"] == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def group_alive(self) -> bool:
        """Whether any process of the server's process group (server, workers) still exists."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def terminate(self, timeout: float = 30.0) -> float:
        """SIGTERM the server; -> seconds until it exited."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        return time.monotonic() - t0

    def close(self) -> None:
        if self.group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()
