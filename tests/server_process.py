"""A real `blockdiff serve` subprocess on a free port, for the server tests: `ServerProcess` for a
server a test starts and stops itself, `serve(...)` for a server fixture (the one way a test module
declares the server it shares)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Metrics(dict):
    """A /metrics scrape, read by prometheus_client's parser (which fails on text that is not the
    exposition format): {'name{labels}': value}, labels sorted by name as prometheus_client writes
    them, and `total` to add up a family's samples (vLLM's are per engine)."""

    def __init__(self, text: str):
        super().__init__()
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        for s in self.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            self[s.name + ("{" + labels + "}" if labels else "")] = s.value

    def total(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples that carry `labels` (0 with none)."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())


def parse_metrics(text: str) -> Metrics:
    return Metrics(text)


def _limit_files(n: int) -> None:
    """In the child before exec: `ulimit -n n`."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


class ServerProcess:
    """`python -m blockdiff serve [MODEL] ARGS...` (no MODEL: the bundled demo) in its own session (so every process it starts can be
    found by its process group), ready once /health answers 200."""

    def __init__(self, model: str | None, *args: str, log_path: str, ready_timeout: float = 180.0,
                 max_open_files: int | None = None, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # With --api-key, /metrics is open unless --metrics-require-api-key: the key is sent either way.
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "BLOCKDIFF_API_KEY"}
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

    def metrics(self) -> Metrics:
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        return parse_metrics(r.text)

    def wait_idle(self, timeout: float = 10.0) -> Metrics:
        """Poll /metrics until no request runs or waits and the KV cache is empty; -> the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m.total("vllm:num_requests_running") == 0 and m.total("vllm:num_requests_waiting") == 0
            if (idle and m.total("vllm:kv_cache_usage_perc") == 0) or time.monotonic() > deadline:
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


def fixture_value(name: str, then=str):
    """An argument of `serve` taken from another fixture (`then` of its value, a string by default)."""
    return lambda request: then(request.getfixturevalue(name))


def serve(model=None, *args, scope: str = "module", params: list | None = None, ids: list | None = None,
          env: dict | None = None, **options):
    """A pytest fixture: one real `python -m blockdiff serve [MODEL] ARGS...` (a `ServerProcess`), started
    when the first test asks for it and closed when its scope ends. Assign it to the fixture's name:

        server = serve(None, "--max-model-len", "256")                 # the bundled demo
        server = serve(fixture_value("tiny"), "--max-num-seqs", "4")  # a model from another fixture

    `model`, each of `args` and each value of `env` (variables added to the server's environment) may be
    a callable of the fixture's `request` (`fixture_value(name)`, or `lambda request: ...` for anything
    computed: `request.getfixturevalue`, `request.param`), resolved when the server starts. With
    `params`, one server per parameter; the server's `param` is it. `options` go to `ServerProcess`
    (ready_timeout, max_open_files). Its log is server.log in a fresh temporary folder."""
    import pytest  # here: benchmarks/server_abuse.py imports this module without pytest

    @pytest.fixture(scope=scope, params=params, ids=ids)
    def server(request, tmp_path_factory):
        def value(arg):
            return arg(request) if callable(arg) else arg

        proc = ServerProcess(value(model), *map(value, args), env={k: value(v) for k, v in (env or {}).items()},
                             log_path=str(tmp_path_factory.mktemp("server") / "server.log"), **options)
        proc.param = getattr(request, "param", None)
        yield proc
        proc.close()

    return server


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HealthProbe:
    """While a `with` block runs, a thread polls /health on one keep-alive connection every 10 ms.
    `idle` is the median latency of 30 probes just before, `worst` the slowest during; `check()`
    asserts every probe got a 200 and that the worst took less than RATIO times the idle median:
    "within 1 s" on a machine that answers /health in 1 ms, scaled to this one's load."""

    RATIO = 1000

    def __init__(self, server: ServerProcess):
        self.server, self.worst, self.statuses = server, 0.0, {}
        self.peak_rss = 0.0  # MiB, the server's, sampled with each probe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._client = httpx.Client(timeout=120)

    def _probe(self) -> float:
        t0 = time.perf_counter()
        try:
            status = self._client.get(self.server.url + "/health").status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        self.statuses[status] = self.statuses.get(status, 0) + 1
        return time.perf_counter() - t0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.worst = max(self.worst, self._probe())
            self.peak_rss = max(self.peak_rss, rss_mib(self.server.proc.pid))
            time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        times = []
        for _ in range(30):
            times.append(self._probe())
            time.sleep(0.005)
        self.idle = statistics.median(times)
        self.statuses.clear()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._client.close()

    def __str__(self) -> str:
        return f"/health idle {self.idle * 1e3:.1f} ms, worst {self.worst * 1e3:.0f} ms (x{self.worst / self.idle:.0f})"

    def check(self) -> None:
        assert set(self.statuses) == {200}, self.statuses
        assert self.worst < self.RATIO * self.idle, str(self)
