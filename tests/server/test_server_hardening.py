"""The server against hostile clients, on a real server: text the tokenizer cannot take, the API
key, large bodies and list limits, slow and silent connections, unfinished bodies from one address,
every response counted in /metrics, and per-client concurrency. No request, no connection pattern
and no text may take the server down, stall it, or hide from /metrics."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_process import HealthProbe, ServerProcess, fixture_value, parse_metrics, serve

from blockdiff.config import EngineConfig
from blockdiff.engine.engine import LLMEngine
from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.entrypoints.openai.server import ServerConfig, build_app

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
HEADER_TIMEOUT = 2


server = serve(fixture_value("tiny"), "--api-key", KEY, "--max-model-len", "256", "--max-denoising-steps", "4",
               "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", "30", "--min-body-rate", "1000")


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, dict, str | None]:
    conn.request("POST", path, body=body, headers=AUTH)
    r = conn.getresponse()
    return r.status, json.loads(r.read()), r.getheader("connection")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# ---- text the tokenizer cannot take ---------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", b'{"prompt": "sort: \\ud800", "max_tokens": 4}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfff"}], "max_tokens": 4}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}'),
])
def test_lone_surrogate_is_a_400_and_keeps_the_connection(server, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    status, error, connection = _post(conn, path, body)
    assert status == 400, error
    assert "lone UTF-16 surrogate" in error["error"]["message"] and error["error"]["param"] in ("prompt", "messages")
    assert connection != "close"
    # The same connection serves the next request.
    status, ok, _ = _post(conn, "/v1/completions", b'{"prompt": "sort: 2 1", "max_tokens": 4}')
    assert status == 200, ok
    conn.close()


@pytest.mark.parametrize("text", ["a\x00b", "\ufffe\uffff\ufdd0", "\U0010ffff", "\ud83d\ude00"])
def test_nul_noncharacters_and_surrogate_pairs_are_served(server, text):
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    status, out, _ = _post(conn, "/v1/chat/completions", body)
    conn.close()
    assert status == 200, out
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


# ---- the API key --------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/version", "/v1/models", "/redoc", "/nowhere"])
def test_everything_but_health_and_metrics_needs_the_key(server, path):
    r = httpx.get(server.url + path, timeout=30)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_metrics_are_scraped_without_the_key_as_from_vllm(server):
    """Prometheus scrapes a vLLM server's /metrics with no credentials; the API still needs the key."""
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    assert parse_metrics(r.text).total("vllm:num_requests_running") == 0
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "sort: 2 1", "max_tokens": 4}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.slow  # a server of its own: ~25 s on the shared machine
def test_metrics_behind_the_key_on_request(tiny, tmp_path):
    proc = ServerProcess(tiny, "--api-key", KEY, "--metrics-require-api-key", "--max-model-len", "64",
                         log_path=str(tmp_path / "server.log"))
    try:
        r = httpx.get(proc.url + "/metrics", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(proc.url + "/metrics", headers=AUTH, timeout=30).status_code == 200
        assert httpx.get(proc.url + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(proc.url + "/health", timeout=30).status_code == 200
    finally:
        proc.close()


def test_two_authorization_headers_are_a_400(server):
    headers = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")]
    r = httpx.get(server.url + "/v1/models", headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    assert "more than one Authorization header" in r.json()["error"]["message"]


def test_the_key_in_x_api_key(server):
    """Anthropic's header carries the key as well as a Bearer token does, under the same rules."""
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}, timeout=30).status_code == 200
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", headers=[("x-api-key", "wrong"), ("x-api-key", KEY)], timeout=30)
    assert r.status_code == 400 and "more than one x-api-key header" in r.json()["error"]["message"]


# ---- large bodies -------------------------------------------------------------------------------------
_SEND = """
import sys, httpx
r = httpx.post(sys.argv[1], content=open(sys.argv[2], "rb").read(), headers={"Authorization": sys.argv[3],
               "Content-Type": "application/json"}, timeout=120)
print(r.status_code, r.text)
"""


def test_a_16mb_body_is_refused_without_stalling_health_or_keeping_memory(server, tmp_path):
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 450_000}).encode()
    assert 14 * 2**20 < len(body) < 16 * 2**20
    (tmp_path / "body.json").write_bytes(body)
    rss_before = _rss_kib(server.proc.pid)
    # Sent from another process, so that this one's GIL does not delay the /health probes.
    sender = subprocess.Popen([sys.executable, "-c", _SEND, server.url + "/v1/chat/completions", str(tmp_path / "body.json"),
                               AUTH["Authorization"]], stdout=subprocess.PIPE, text=True)
    worst = 0.0
    with httpx.Client(timeout=30) as health:
        while sender.poll() is None:
            t0 = time.perf_counter()
            assert health.get(server.url + "/health").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.02)
    status, error = sender.stdout.read().split(" ", 1)
    assert status == "400", error
    assert "a list of more than 4097 items" in json.loads(error)["error"]["message"]
    grown_mib = (_rss_kib(server.proc.pid) - rss_before) / 1024
    print(f"/health worst latency while refusing {len(body) / 2**20:.1f} MiB: {worst * 1000:.0f} ms; RSS grew {grown_mib:.0f} MiB")
    # Before: /health stalled 11.6 s and RSS grew by 2.5 GB for good. Generous bounds for a busy machine.
    assert worst < 1.0
    assert grown_mib < 200


@pytest.mark.parametrize("field, body", [
    ("messages", {"messages": [{"role": "user", "content": "x"}] * 4097}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1025}]}),
    ("stop", {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17}),
])
def test_list_limits(server, field, body):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert "at most" in r.json()["error"]["message"]


def test_too_many_prompts(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["x"] * 2049}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


# ---- connections --------------------------------------------------------------------------------------
def test_a_silent_connection_is_closed_after_the_header_timeout(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(HEADER_TIMEOUT + 20)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the server
        assert HEADER_TIMEOUT - 0.5 < time.monotonic() - t0


def _reply(s: socket.socket) -> tuple[bytes, dict]:
    """The status line and the JSON body of the response on `s`, read until the server closes it."""
    s.settimeout(30)
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0], json.loads(body)


def test_a_body_that_never_arrives_is_a_408(server):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        status, error = _reply(s)  # the refused connection is closed
    assert status == b"HTTP/1.1 408 Request Timeout", status
    assert error["error"]["code"] == "request_timeout"


def test_a_trickled_body_is_cut_off_at_the_minimum_rate(server):
    """10 bytes a second of a 10 kB body: before, it held the connection for --body-timeout (60 s),
    renewable; now it must average --min-body-rate once --header-timeout has passed."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 10000\r\n\r\n")
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 25:
                s.sendall(b"          ")
                time.sleep(1)
        except OSError:  # closed by the server
            pass
        status, error = _reply(s)
    assert HEADER_TIMEOUT <= time.monotonic() - t0 < 25
    assert status == b"HTTP/1.1 408 Request Timeout", status
    assert "--min-body-rate" in error["error"]["message"]


def test_uvicorns_own_refusal_is_openai_shaped_and_counted(server):
    before = server.metrics().get('blockdiff:http_refusals_total{reason="invalid_http"}', 0)
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        status, error = _reply(s)
    assert status.startswith(b"HTTP/1.1 400"), status
    assert error["error"]["code"] == "invalid_http"
    assert server.metrics()['blockdiff:http_refusals_total{reason="invalid_http"}'] == before + 1


def test_unfinished_bodies_from_one_address_cannot_take_the_connections(tiny, tmp_path):
    """1,100 connections, each sending the headers of a 100 kB body and then
    only "{", under `ulimit -n 1024`. Before: every request, /health included, got uvicorn's plain
    503 for as long as they were held. Now the address may hold --max-client-uploads of them; the
    rest get a counted, OpenAI-shaped 429 and are closed, and every whole request is served."""
    server = ServerProcess(tiny, "--max-model-len", "64", log_path=str(tmp_path / "server.log"), max_open_files=1024)
    held, refused = [], 0
    try:
        with HealthProbe(server) as probe:
            for _ in range(1100):
                try:
                    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100000\r\n\r\n{")
                    held.append(s)
                except OSError:  # the server's descriptors ran out for a moment
                    refused += 1
                time.sleep(0.002)
            # Another client (Linux answers on all of 127/8) is served, and so is a whole request from the
            # attacker's address: only bodies still arriving are capped.
            with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as other:
                r = other.post(server.url + "/v1/completions", json={"prompt": "sort: 2 1", "max_tokens": 4})
            assert r.status_code == 200, r.text
            mine = httpx.post(server.url + "/v1/completions", json={"prompt": "sort: 2 1", "max_tokens": 4}, timeout=60)
            assert mine.status_code == 200, mine.text
        print(f"{len(held)} connections opened, {refused} failed to connect; {probe}")
        probe.check()
        m = server.metrics()
        assert m['blockdiff:http_refusals_total{reason="too_many_uploads"}'] >= 1000
        assert m['blockdiff:http_responses_total{status="429"}'] >= 1000
        for s in held:
            s.close()
        held.clear()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "sort: 2 1", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for s in held:
            s.close()
        server.close()


def test_accepted_connections_have_nagle_off():
    """The listening socket is made so that asyncio sets TCP_NODELAY on what it accepts: with Nagle on,
    a response written in two parts waited for the client's delayed ACK, 40 ms a keep-alive request."""
    from blockdiff.entrypoints.openai.server import _bind

    async def main() -> int:
        accepted = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        sock = _bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Protocol, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        nodelay = await accepted
        writer.close()
        server.close()
        return nodelay

    assert asyncio.run(main()) == 1


# ---- every response is counted ------------------------------------------------------------------------
def test_a_500_is_counted_and_the_app_survives(tiny, monkeypatch):
    """In-process: no request makes the real server fail any more, so the tokenizer is made to."""
    engine = LLMEngine(EngineConfig(tiny, max_model_len=64))

    def broken(text, add_special_tokens=True):
        raise TypeError("tokenizer broke")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    app = build_app(AsyncEngine(engine), ServerConfig(["tiny"]))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)  # raises what escapes the app: nothing may
            async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=30) as client:
                r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
                assert r.status_code == 500
                assert r.json()["error"]["type"] == "server_error"
                metrics = (await client.get("/metrics")).text
        assert 'blockdiff:http_responses_total{status="500"} 1.0' in metrics, metrics

    asyncio.run(main())


# ---- per-client concurrency, in engine requests -----------------------------------------------------
def test_a_client_over_its_concurrency_limit_gets_429(tiny, tmp_path):
    server = ServerProcess(tiny, "--max-model-len", "2048", "--max-client-concurrency", "3",
                           log_path=str(tmp_path / "server.log"))
    long = {"prompt": "sort: 3 2 1", "max_tokens": 1500, "ignore_eos": True, "max_denoising_steps": 16, "stream": True,
            "n": 2}
    small = {"prompt": "sort: 2 1", "max_tokens": 4}
    try:
        # A call's choices are engine requests: four of them are more than one client may ever run.
        r = httpx.post(server.url + "/v1/completions", json={**small, "n": 4}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_requests", r.text
        with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=60) as first:
            lines = first.iter_lines()  # kept: a collected iterator would close the stream
            next(line for line in lines if line.startswith("data: "))  # it is running: 2 of 3 held
            r = httpx.post(server.url + "/v1/completions", json={**small, "n": 2}, timeout=30)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "too_many_requests"
            assert httpx.post(server.url + "/v1/completions", json=small, timeout=60).status_code == 200  # the third
            # Another client (another host: Linux answers on all of 127/8) is not held back.
            with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as other:
                r = other.post(server.url + "/v1/completions", json={**small, "n": 3})
            assert r.status_code == 200, r.text
        # The first client's request ended (it hung up): its next one is served.
        deadline = time.monotonic() + 30
        while (r := httpx.post(server.url + "/v1/completions", json={**small, "n": 3},
                               timeout=60)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.status_code == 200, r.text
    finally:
        server.close()
