"""Constraint builds bounded in time, memory and size, and fair, through the real server on the
bundled demo model: exploding regexes and schemas, a forced tool's regex, JSON inside strings and an
empty enum, each scaled to run in seconds, get a 4xx naming the bound while /health keeps
answering; no build process grows past its memory bound or outlives its requests or the server; and a cached schema is served
at its idle pace while abandoned builds run.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time

import httpx
import pytest
from helpers import wait_until
from server_process import HealthProbe, ServerProcess, rss_mib, serve

from benchmarks.structured_outputs import SCHEMA as TWENTY_FIELDS
from benchmarks.structured_outputs import plain
from blockdiff.demo.tasks import WEATHER_TOOL
from blockdiff.sampling_params import StructuredOutputsParams
from blockdiff.structured.lengths import min_chars

MEMORY_MIB = 512
ARGS = ("--max-model-len", "512", "--structured-outputs-memory", f"{MEMORY_MIB}MiB", "--structured-outputs-timeout", "30")
# Slow to build on any vocabulary (a DFA of 2^13 states, a few seconds), and cheap in memory: `i` makes each distinct.
SLOW = r"(a|b)*a(a|b){{12}}(c{{{i}}})?"


def start(tmp_path_factory) -> ServerProcess:
    return ServerProcess(None, *ARGS, log_path=str(tmp_path_factory.mktemp("server") / "server.log"))


server = serve(None, *ARGS)


def build_processes(server: ServerProcess) -> list[int]:
    """The server's build processes (blockdiff.structured.index) alive now, orphans included: by
    the process group the server leads."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            if b"blockdiff.structured.index" in cmdline and os.getpgid(int(entry)) == server.proc.pid:
                pids.append(int(entry))
        except (OSError, ProcessLookupError):
            continue
    return pids


def chat(server: ServerProcess, timeout: float = 60, **body) -> httpx.Response:
    body = {"model": "demo", "messages": [{"role": "user", "content": "sort: 3 1 2"}], "max_tokens": 16, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=timeout)


def nested(width: int, depth: int) -> dict:
    """An object schema `depth` levels deep, each level `width` optional properties: outlines-core's
    regex (and a forced call's) has an alternative per way of leaving properties out."""
    if depth == 0:
        return {"type": "string"}
    return {"type": "object", "properties": {f"p{i}": nested(width, depth - 1) for i in range(width)}}


def refused(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error["message"]


class BuildMemory:
    """While a `with` block runs, the largest RSS (MiB) of any of the server's build processes."""

    def __init__(self, server: ServerProcess):
        self.server, self.peak, self.seen = server, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in build_processes(self.server):
                try:
                    self.peak = max(self.peak, rss_mib(pid))
                    self.seen += 1
                except (OSError, StopIteration):
                    pass
            time.sleep(0.05)

    def __enter__(self) -> BuildMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---- memory ---------------------------------------------------------------------------------------
def test_a_regex_past_the_memory_bound_is_a_400(server):
    """A 27-byte regex once grew a build to 6 GB; here it stops at --structured-outputs-memory."""
    with HealthProbe(server) as health, BuildMemory(server) as builds:
        t0 = time.monotonic()
        r = chat(server, structured_outputs={"regex": r"(\p{L}{1,1000}){1,1000}"})
        took = time.monotonic() - t0
    refused(r, "structured_outputs", "--structured-outputs-memory")
    assert took < 25, took  # not the 30 s timeout: the memory bound stopped it
    assert builds.seen and builds.peak < MEMORY_MIB, (builds.seen, builds.peak)
    health.check()
    # Refused again at once, from the cache of failures: no second build.
    t0 = time.monotonic()
    refused(chat(server, structured_outputs={"regex": r"(\p{L}{1,1000}){1,1000}"}), "structured_outputs", "GiB")
    assert time.monotonic() - t0 < 2


def test_a_schema_whose_regex_explodes_is_a_400(server):
    """6 optional properties 4 deep (44 KB; 5 deep is 275 KB): a 13 MB regex, refused by
    its length in the build process, as response_format and as structured_outputs.json text."""
    with HealthProbe(server) as health:
        r = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": nested(6, 4)}})
        refused(r, "response_format", "characters, more than the")
        r = chat(server, structured_outputs={"json": json.dumps(nested(7, 4))})
        refused(r, "structured_outputs", "characters, more than the")
        r = httpx.post(server.url + "/v1/responses", json={"model": "demo", "input": "x", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": nested(6, 4)}}}, timeout=60)
        refused(r, "text.format", "characters, more than the")
    health.check()
    assert not build_processes(server)


def test_the_twenty_field_schema_still_builds(server):
    """The largest honest schema (20 fields, an array, enums, a nested object) is within every bound:
    its automaton is built, and max_tokens at the length its request shows (the demo's tokens are
    one character each) is refused for being shorter than its shortest output, which the automaton
    knows; max_tokens=1 is refused from the request alone."""
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": TWENTY_FIELDS}}
    shown = min_chars(StructuredOutputsParams(json=TWENTY_FIELDS))
    refused(chat(server, max_tokens=shown, response_format=fmt), "max_tokens", "whose shortest text takes")
    refused(chat(server, max_tokens=1, response_format=fmt), "max_tokens", "too small for the structured output")
    # A forced call's arguments take no length bounds or formats: the schema without them.
    tool = {"type": "function", "function": {"name": "save_user", "parameters": plain(TWENTY_FIELDS)}}
    tools = {"tools": [tool], "tool_choice": "required"}
    refused(chat(server, max_tokens=1, **tools), "max_tokens", "too small for the structured output")


# ---- a length no output within max_tokens can have -----------------------------------------------
IMPOSSIBLE = {"type": "string", "minLength": 100_000}


def messages(server: ServerProcess, **body) -> httpx.Response:
    body = {"model": "demo", "messages": [{"role": "user", "content": "sort: 3 1 2"}], "max_tokens": 16, **body}
    return httpx.post(server.url + "/v1/messages", json=body, timeout=60)


def test_a_length_no_output_within_max_tokens_has_is_a_400_before_any_build(server):
    """A string of minLength 100,000 under max_tokens 16 held a build worker until the build's time
    bound (60 s by default) before its 400; a regex of a fixed length as well. Refused from the
    request, through every API that takes a schema, at once and with no build started."""
    deep = {"type": "object", "properties": {"a": {"type": "array", "minItems": 2, "items": {
        "type": "object", "properties": {"b": IMPOSSIBLE}, "required": ["b"]}}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": IMPOSSIBLE}}
    cases = [
        (lambda: chat(server, response_format=fmt), "max_tokens", 100_002),
        (lambda: chat(server, max_completion_tokens=16, response_format=fmt), "max_completion_tokens", 100_002),
        (lambda: chat(server, structured_outputs={"json": json.dumps(deep)}), "max_tokens", 200_025),
        (lambda: chat(server, guided_json=IMPOSSIBLE), "max_tokens", 100_002),
        (lambda: chat(server, guided_regex="a{100000}"), "max_tokens", 100_000),
        (lambda: httpx.post(server.url + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 16,
                                                                   "structured_outputs": {"regex": "(ab){50000}"}},
                            timeout=60), "max_tokens", 100_000),
        (lambda: httpx.post(server.url + "/v1/responses", json={"model": "demo", "input": "x", "max_output_tokens": 16,
                                                                 "text": {"format": {"type": "json_schema", "name": "x",
                                                                                     "schema": IMPOSSIBLE}}},
                            timeout=60), "max_output_tokens", 100_002),
    ]
    with HealthProbe(server) as health, BuildMemory(server) as builds:
        for send, param, need in cases:
            t0 = time.monotonic()
            r = send()
            took = time.monotonic() - t0
            refused(r, param, "too small for the structured output", f"at least {need} characters")
            assert took < 5, (param, took)  # a build runs until its 30 s bound here
        t0 = time.monotonic()
        r = messages(server, output_config={"format": {"type": "json_schema", "schema": IMPOSSIBLE}})
        took = time.monotonic() - t0
        assert r.status_code == 400 and took < 5, (r.text, took)
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert "max_tokens (16) is too small for the structured output" in error["error"]["message"], error
    assert builds.seen == 0
    health.check()


def test_a_possible_length_is_still_served(server):
    schema = {"type": "string", "minLength": 3, "maxLength": 6}
    r = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200, r.text
    assert 3 <= len(json.loads(r.json()["choices"][0]["message"]["content"])) <= 6
    r = messages(server, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.status_code == 200, r.text
    assert 3 <= len(json.loads(r.json()["content"][0]["text"])) <= 6


# ---- a forced tool's regex ------------------------------------------------------------------------
@pytest.mark.parametrize("width", [6, 7])
def test_a_forced_tool_with_an_exploding_schema_is_a_400(server, width):
    """The 6 x 5 (275 KB) and 7 x 5 (572 KB) parameter schemas, on /v1/chat/completions and
    /v1/responses: refused before the regex is written, off the loop."""
    params = nested(width, 5)
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    before = rss_mib(server.proc.pid)
    with HealthProbe(server) as health:
        refused(chat(server, tools=[tool], tool_choice="required"), "tools", "a constraint may have")
        r = httpx.post(server.url + "/v1/responses", json={
            "model": "demo", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": params}],
            "tool_choice": "required"}, timeout=60)
        refused(r, "tools", "a constraint may have")
    health.check()
    assert health.peak_rss - before < 512, (before, health.peak_rss)  # unbounded, the 7 x 5 took 6.1 GB


# ---- JSON inside strings --------------------------------------------------------------------------
def test_constraint_json_text_nested_2000_deep_is_a_400(server):
    deep = '{"items":' * 2000 + "{}" + "}" * 2000
    refused(chat(server, structured_outputs={"json": deep}), "structured_outputs", "more than 64 deep")
    refused(chat(server, guided_json=deep), "guided_json", "more than 64 deep")


def test_responses_call_arguments_nested_deep_are_a_400(server):
    """`"[" * 100000` as a function call's arguments: decoded in the pool within the body's bounds."""
    def post(arguments: str) -> httpx.Response:
        call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments}
        return httpx.post(server.url + "/v1/responses", json={"model": "demo", "input": [
            {"role": "user", "content": "weather in Paris"}, call]}, timeout=60)

    with HealthProbe(server) as health:
        refused(post("[" * 100_000), "input", "input[1].arguments", "more than 64 deep")
        refused(post("[1," * 1_000_000), "input", "input[1].arguments")
    health.check()


# ---- an empty enum --------------------------------------------------------------------------------
def test_an_empty_enum_is_a_400(server):
    refused(chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}),
            "response_format", "non-empty")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}}}
    refused(chat(server, tools=[tool], tool_choice="required"), "tools", "non-empty")


# ---- fairness -------------------------------------------------------------------------------------
def test_a_cached_schema_is_not_delayed_by_abandoned_builds(server):
    """Eight clients ask for distinct slow regexes and hang up after 1 s: their builds are killed, and
    meanwhile another client's cached schema is answered within 5x its idle time."""
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER_TOOL["function"]["parameters"]}}
    cached = dict(response_format=fmt, max_tokens=24, seed=0)
    assert chat(server, **cached).status_code == 200  # built once
    times = []
    for _ in range(5):
        t0 = time.monotonic()
        assert chat(server, **cached).status_code == 200
        times.append(time.monotonic() - t0)
    idle = statistics.median(times)

    def abandon(i: int) -> None:
        try:
            chat(server, timeout=1.0, structured_outputs={"regex": SLOW.format(i=i + 1)})
        except httpx.ReadTimeout:
            pass  # hung up, as meant

    threads = [threading.Thread(target=abandon, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the builds are queued or running
    t0 = time.monotonic()
    assert chat(server, **cached).status_code == 200
    during = time.monotonic() - t0
    for t in threads:
        t.join()
    assert during < 5 * idle, (during, idle)
    assert wait_until(lambda: not build_processes(server), 3), "builds went on after their clients hung up"


@pytest.mark.slow
def test_builds_are_fair_across_clients(server):
    """One client (127.0.0.1) queues six slow builds; another (127.0.0.2) asks for one new schema: it
    is built after those running when it came, not after all six, so at least two of the six are
    still unfinished when it is answered (first come, first served: none or one)."""
    finished: list[float] = []

    def flood(i: int) -> None:
        chat(server, timeout=120, structured_outputs={"regex": SLOW.format(i=100 + i)})
        finished.append(time.monotonic())

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=120) as other:
        r = other.post(server.url + "/v1/chat/completions", json={
            "model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 16,
            "structured_outputs": {"regex": SLOW.format(i=200)}})
    answered = time.monotonic()
    for t in threads:
        t.join()
    assert r.status_code < 500, r.text
    assert len(finished) == 6
    assert sum(t > answered for t in finished) >= 2, (sorted(finished), answered)


# ---- builds die with the server --------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_build_outlives_the_server(tmp_path_factory, sig):
    """A build running when the server is stopped (SIGTERM) or killed (SIGKILL) is gone 5 s after."""
    proc = start(tmp_path_factory)

    def build() -> None:
        try:
            httpx.post(proc.url + "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 16,
                                                           "structured_outputs": {"regex": r"(\p{L}{1,1000}){1,1000}"}},
                       timeout=60)
        except httpx.HTTPError:
            pass  # the server went away under it, as meant

    try:
        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        assert wait_until(lambda: build_processes(proc), 20), "no build started"
        proc.proc.send_signal(sig)
        proc.proc.wait(30)
        assert wait_until(lambda: not build_processes(proc), 5), "a build outlived the server"
    finally:
        proc.close()
