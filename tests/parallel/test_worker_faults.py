"""A lost tensor-parallel worker (killed, or stopped) under load or while idle.
The server notices within the worker timeout, ends the requests that were running with a 503 that
names no PID, restarts its workers and serves again, all in the same process; if the workers cannot
be restarted, it exits non-zero. A real server with TP=2 on gloo."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import httpx
import pytest
from server_process import ServerProcess, fixture_value, serve

WORKER_TIMEOUT = 4
LONG = {"prompt": "sort: 5 4 3 2 1", "max_tokens": 1500, "ignore_eos": True, "max_denoising_steps": 16}
SHORT = {"prompt": "sort: 2 1", "max_tokens": 8}
# Noticing takes the worker timeout (+5 s for a worker that might still report why); then the new
# workers start and load the weights.
NOTICED_WITHIN = WORKER_TIMEOUT + 5 + 10
SERVES_AGAIN_WITHIN = 60


def _workers(pid: int) -> set[int]:
    """Child processes of `pid` (the server's tensor-parallel workers)."""
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            if ppid == pid:
                children.add(int(entry))
    return children


def _start_load(server: ServerProcess, count: int) -> tuple[list[threading.Thread], list]:
    results: list = []

    def one():
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=LONG, timeout=60)
        results.append((r.status_code, r.json(), time.monotonic() - t0))

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.metrics().total("vllm:num_requests_running") < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return threads, results


def _serves_again(server: ServerProcess, since: float) -> float:
    """Seconds from `since` until a new request succeeds."""
    while time.monotonic() - since < SERVES_AGAIN_WITHIN:
        try:
            if httpx.post(server.url + "/v1/completions", json=SHORT, timeout=30).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no successful request within {SERVES_AGAIN_WITHIN} s:\n{server.log()[-4000:]}")


def _cached_prefix_tokens(server: ServerProcess) -> list[int]:
    """A seeded request whose 40-token prompt fills prefix-cache blocks: run again after a restart,
    it must not reuse blocks the lost workers held (greedy, so the tokens are comparable)."""
    body = {"prompt": list(range(3, 43)), "max_tokens": 8, "seed": 7, "t_min": 1e-6, "t_max": 2e-6,
            "return_token_ids": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _lose_a_worker_under_load(server: ServerProcess, sig: signal.Signals) -> None:
    before = _cached_prefix_tokens(server)
    (worker,) = _workers(server.proc.pid)
    threads, results = _start_load(server, 3)
    lost_at = time.monotonic()
    os.kill(worker, sig)
    for t in threads:
        t.join(60)
    noticed = time.monotonic() - lost_at
    assert len(results) == 3
    for status, body, _ in results:
        assert status == 503, body
        message = body["error"]["message"]
        assert "worker was lost" in message and "pid" not in message.lower() and "/" not in message, message
    assert noticed < NOTICED_WITHIN, noticed
    serving = _serves_again(server, lost_at)
    print(f"{sig.name}: in-flight requests ended after {noticed:.1f} s, serving again after {serving:.1f} s")
    assert server.proc.poll() is None  # the same server process
    assert worker not in _workers(server.proc.pid) and len(_workers(server.proc.pid)) == 1
    assert not os.path.exists(f"/proc/{worker}") or open(f"/proc/{worker}/stat").read().split()[2] == "Z"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert _cached_prefix_tokens(server) == before  # the new workers' cache holds no stale prefix


server = serve(fixture_value("tiny"), "--tensor-parallel-size", "2", "--max-model-len", "2048",
               "--worker-timeout", str(WORKER_TIMEOUT))


@pytest.mark.slow
def test_killed_worker_under_load(server):
    _lose_a_worker_under_load(server, signal.SIGKILL)


@pytest.mark.slow
def test_stopped_worker_under_load(server):
    _lose_a_worker_under_load(server, signal.SIGSTOP)


@pytest.mark.slow
def test_stopped_worker_while_idle_is_noticed(server):
    (worker,) = _workers(server.proc.pid)
    stopped_at = time.monotonic()
    os.kill(worker, signal.SIGSTOP)
    # The heartbeat notices: the worker is replaced without any request being sent.
    while worker in _workers(server.proc.pid) and time.monotonic() - stopped_at < NOTICED_WITHIN:
        time.sleep(0.2)
    noticed = time.monotonic() - stopped_at
    assert noticed < NOTICED_WITHIN, server.log()[-3000:]
    print(f"idle SIGSTOP noticed after {noticed:.1f} s")
    _serves_again(server, stopped_at)


@pytest.mark.slow
def test_sigterm_ends_even_with_a_stopped_worker(tiny, tmp_path):
    server = ServerProcess(tiny, "--tensor-parallel-size", "2", "--max-model-len", "2048", "--shutdown-timeout", "1",
                           log_path=str(tmp_path / "server.log"))
    try:
        (worker,) = _workers(server.proc.pid)
        threads, _ = _start_load(server, 1)
        os.kill(worker, signal.SIGSTOP)
        # Default worker timeout (60 s): only the bounded shutdown ends this.
        seconds = server.terminate(timeout=60)
        for t in threads:
            t.join(30)
        print(f"SIGTERM with a stopped worker: exited after {seconds:.1f} s")
        assert seconds < 1 + 10, server.log()[-3000:]
        assert not server.group_alive()
    finally:
        server.close()


@pytest.mark.slow
def test_server_exits_nonzero_when_workers_cannot_restart(tiny, tmp_path):
    model = shutil.copytree(tiny, tmp_path / "model")
    server = ServerProcess(str(model), "--tensor-parallel-size", "2", "--max-model-len", "256",
                           "--worker-timeout", str(WORKER_TIMEOUT), log_path=str(tmp_path / "server.log"))
    try:
        (worker,) = _workers(server.proc.pid)
        shutil.rmtree(model)  # every restart fails to load the weights
        os.kill(worker, signal.SIGKILL)
        code = server.proc.wait(60)
        assert code == 1, server.log()[-3000:]
        log = server.log()
        assert "restart 3 of 3 failed" in log and "could not be restarted" in log
        assert not server.group_alive()
    finally:
        server.close()
