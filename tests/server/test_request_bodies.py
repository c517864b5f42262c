"""Request bodies built to stall or exhaust the server, against one real server of the demo model:
chat templates and tool arguments worked off the event loop and within a deadline, `n` that
multiplies no work, client mistakes that are 4xx without a traceback, only JSON bodies read, and
streams left unread dropped past their buffer. No request body, however it is built, stalls
/health, keeps memory, or gets anything but a 4xx; a good request is served after each.

Each attack is sent from a thread while `HealthProbe` polls /health; it must answer within
HealthProbe.RATIO times its idle latency (1 s, scaled to this machine's load).
Before the work these stalled /health for 2 to 60 s and kept up to 2 GB."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_process import HealthProbe, ServerProcess, cpu_seconds, fixture_value, rss_mib, serve

from blockdiff.demo import demo_checkpoint
from blockdiff.tokenizer import Tokenizer

TIMEOUT = 3.0  # --preprocess-timeout
JSON = {"Content-Type": "application/json"}
_CHAT = "/v1/chat/completions"
# The demo's template, behind a loop that reads every pair of messages and writes nothing when a
# request sets `stall`: quadratic work that no limit on the output can cut short.
STALL = ("{%- if stall -%}{%- for m in messages -%}{%- for o in messages -%}{%- if o['role'] == m['role'] -%}"
         "{%- endif -%}{%- endfor -%}{%- endfor -%}{%- endif -%}")


@pytest.fixture(scope="module")
def stalling_template(tmp_path_factory) -> str:
    template = tmp_path_factory.mktemp("stalls") / "template.jinja"
    template.write_text(STALL + Tokenizer.from_pretrained(demo_checkpoint()).chat_template)
    return str(template)


server = serve(None, "--chat-template", fixture_value("stalling_template"), "--preprocess-timeout", str(TIMEOUT),
               "--max-stream-buffer", "64KiB")


def _attack(server: ServerProcess, path: str, body: bytes | dict, times: int = 1) -> tuple[list[httpx.Response], HealthProbe]:
    """Send `body` `times` times from a thread while /health is probed; -> the responses, the probe."""
    content = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    responses = []

    def send():
        with httpx.Client(timeout=300) as c:
            responses.extend(c.post(server.url + path, content=content, headers=JSON) for _ in range(times))

    with HealthProbe(server) as probe:
        sender = threading.Thread(target=send)
        sender.start()
        sender.join()
    return responses, probe


def _served_after(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "sort: 3 1 2"}],
                                                               "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text


def _refused(server, path, body, status, param=None, code=None, times=1, says=None) -> None:
    rss = rss_mib(server.proc.pid)
    responses, probe = _attack(server, path, body, times)
    grown = rss_mib(server.proc.pid) - rss
    print(f"{path}: {[r.status_code for r in responses]}, {probe}, RSS +{grown:.0f} MiB")
    for r in responses:
        assert r.status_code == status, r.text[:1000]
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
        assert says is None or says in error["message"], error
    probe.check()
    assert grown < 200
    _served_after(server)


def _tool_chat(tool_messages: int) -> list[dict]:
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
            + [{"role": "tool", "tool_call_id": "c0", "content": "x"}] * tool_messages)


def _with_arguments(arguments: str) -> dict:
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c0", "content": "ok"}], "max_tokens": 4}


# ---- template, tokenizer and arguments, before and off the event loop --------------------------------
def test_a_quadratic_template_over_4094_tool_messages_is_cut_off_by_the_context(server):
    # The demo template looks back over every earlier message for each tool message. Before: 200 after
    # 60.7 s here, and 400 after 17 s with 2,000. Now 4,094 have more text than the context holds, and
    # 2,000 are cut off once the template has written as much.
    _refused(server, "/tokenize", {"messages": _tool_chat(4094)}, 400, "messages", says="cannot fit in max_model_len")
    _refused(server, "/v1/chat/completions", {"messages": _tool_chat(2000), "max_tokens": 4}, 400, "messages",
             says="more than the context can hold")


def test_template_work_past_the_deadline_is_a_413_and_is_abandoned(server):
    body = {"messages": [{"role": "user", "content": ""}] * 4000, "max_tokens": 4, "chat_template_kwargs": {"stall": True}}
    t0 = time.monotonic()
    _refused(server, "/v1/chat/completions", body, 413, code="request_too_complex", says="--preprocess-timeout")
    assert time.monotonic() - t0 > TIMEOUT
    # Abandoned: the server is idle again, not rendering the remaining 16 million pairs.
    cpu = cpu_seconds(server.proc.pid)
    time.sleep(1.0)
    used = cpu_seconds(server.proc.pid) - cpu
    print(f"CPU the server used in the second after the 413: {used:.2f} s")
    assert used < 0.5


@pytest.mark.parametrize("what, body", [
    ("a 15 MB tool description", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": "f", "description": "x" * 15_000_000}}]}),
    ("128 tools of 115 kB descriptions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": f"f{i}", "description": "x" * 115_000}} for i in range(128)]}),
    ("15 MB tool-call arguments", _with_arguments(json.dumps({"a": "x" * 15_000_000}))),
])
def test_text_outside_content_counts_before_the_template(server, what, body):
    _refused(server, "/v1/chat/completions", body, 400, "messages", says="cannot fit in max_model_len")


def test_arguments_are_json_within_the_bounds_of_a_body(server):
    # Before: 24 s of stall each, and RSS from 718 MB to 2.8 GB for good after three.
    bomb = _with_arguments(json.dumps({"a": [{}] * 1_500_000}, separators=(",", ":")))
    _refused(server, "/v1/chat/completions", json.dumps(bomb).encode(), 400, "messages", times=3)


@pytest.mark.parametrize("path, says, body", [
    (_CHAT, "more than 32768 JSON objects", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 1000}] * 40}),
    ("/v1/completions", "more than 2097152 values", {"prompt": [[5] * 1100] * 2048, "max_tokens": 4}),
    (_CHAT, "more than 64 deep", {"messages": [{"role": "user", "content": "hi", "x": json.loads("[" * 64 + "]" * 64)}]}),
    # Python's digit limit was once a 500.
    ("/v1/completions", "a number Python cannot read", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
])
def test_bodies_are_decoded_within_bounds(server, path, says, body):
    _refused(server, path, body, 400, says=says)


# ---- n multiplies nothing -----------------------------------------------------------------------------
def test_n_times_a_long_draft_is_refused_before_any_copy(server):
    # Before: 200 after 56 s, /health stalled 51 s, +700 MB kept.
    body = {"prompt": "hi", "max_tokens": 4, "n": 32, "draft": [5] * 2_000_000}
    _refused(server, "/v1/completions", body, 400, says="a list of more than 4097 items")
    body["draft"] = [5] * 2000  # what the decoder lets through, the draft's own limit refuses
    _refused(server, "/v1/completions", body, 400, "draft", says="at most max_model_len=1024")


def test_choices_times_token_lists_is_bounded(server):
    # 128 choices of 16 prompts, each bringing its prompt, the draft and the stop ids: 6.4 M ids.
    body = {"prompt": [[5] * 1000] * 16, "n": 128, "max_tokens": 4, "draft": [5] * 1024, "stop_token_ids": [5] * 1024}
    _refused(server, "/v1/completions", body, 400, "n", says="more than 4194304")


def test_choices_share_their_checked_lists_and_draw_from_their_seeds(server):
    body = {"prompt": "sort: 3 1 2", "max_tokens": 8, "n": 4, "seed": 7, "draft": [5] * 1000, "stop_token_ids": [1] * 1000,
            "return_token_ids": True}
    together = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    for i in (0, 3):
        alone = httpx.post(server.url + "/v1/completions", json={**body, "n": 1, "seed": 7 + i}, timeout=60).json()
        assert alone["choices"][0]["token_ids"] == together[i]["token_ids"]


# ---- client mistakes are 4xx, one log line each, no traceback ---------------------------------
@pytest.mark.parametrize("what, body, says", [
    # Once a RecursionError in the template's recursive format_argument, an 86 kB traceback each.
    ("arguments nested 200 deep", _with_arguments("[" * 200 + "]" * 200), "more than 64 deep"),
    ("arguments nested 60 deep", _with_arguments('{"a":' * 60 + "1" + "}" * 60), None),
    # Once AttributeError and TypeError, answered 500.
    ("properties not an object", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1, 2]}}}]},
     "properties must be an object"),
    ("a lone surrogate inside the arguments", _with_arguments('{"a":"\\ud800"}'), "lone UTF-16 surrogate"),
])
def test_client_mistakes_are_4xx_without_a_traceback(server, what, body, says):
    log_before = len(server.log())
    r = httpx.post(server.url + _CHAT, json=body, timeout=60)
    if says is None:  # within the bounds: served
        assert r.status_code == 200, (what, r.text)
    else:
        assert r.status_code == 400, (what, r.text)
        assert says in r.json()["error"]["message"], (what, r.text)
    written = server.log()[log_before:]
    # One line of ours at most (a refusal's reason), beside uvicorn's access line.
    ours = [line for line in written.splitlines() if not line.startswith("INFO:     ")]
    assert "Traceback" not in written and len(ours) <= 1, written
    _served_after(server)


# ---- only JSON bodies (no cross-site form posts), HEAD /health, unread streams ----------------------
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_read(server, content_type):
    """A web page can post these to any address without a CORS preflight."""
    before = server.metrics().get('blockdiff:http_refusals_total{reason="unsupported_media_type"}', 0)
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers, timeout=30)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert server.metrics()['blockdiff:http_refusals_total{reason="unsupported_media_type"}'] == before + 1


def test_head_health(server):
    r = httpx.head(server.url + "/health", timeout=30)
    assert r.status_code == 200 and r.content == b""


def test_a_stream_left_unread_is_dropped_past_its_buffer(server):
    """Before: a stream never read kept its output queued until the client hung up (1.5 MB per demo
    stream with drafts and logprobs). Now the connection is dropped past --max-stream-buffer (64 KiB
    here) and the call's engine requests end."""
    closed = 'blockdiff:connections_closed_total{reason="unread_stream"}'
    before = server.metrics().get(closed, 0)
    body = json.dumps({"prompt": "sort: 1 2", "max_tokens": 1000, "ignore_eos": True, "stream": True, "n": 16,
                       "stream_drafts": True, "logprobs": 20, "max_denoising_steps": 2}).encode()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 120
        while server.metrics().get(closed, 0) == before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert server.metrics().get(closed, 0) == before + 1
        m = server.wait_idle(30)  # its 16 requests were aborted
        assert m.total("vllm:num_requests_running") == 0 and m.total("vllm:num_requests_waiting") == 0
        s.settimeout(30)
        try:
            while s.recv(65536):  # what was sent before the drop, then the end
                pass
        except ConnectionResetError:
            pass
    assert "dropping a stream" in server.log()
    _served_after(server)
