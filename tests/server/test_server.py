"""The OpenAI-compatible server, driven over HTTP by the official `openai` client and raw httpx.

One real server (a subprocess) serves the whole module; an offline LLM on the same checkpoint is
the oracle: a seeded request must come back exactly as LLM.generate returns it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os

import httpx
import openai
import pytest
from server_process import ServerProcess, fixture_value, serve

from blockdiff import LLM, SamplingParams
from blockdiff.config import EngineConfig
from blockdiff.worker.kv_cache import cache_bytes_per_block, sliding_blocks_needed, sliding_bytes_per_block
from blockdiff.model.loader import load_model

STEPS = 4  # the server's --max-denoising-steps
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
KV_BLOCKS = 24  # of 16 tokens: fewer than 16 concurrent requests need, so some wait for the cache
KEY = "test-key"
MODEL = "tiny"


def _kv_bytes(tiny: str) -> str:
    """The KV cache of KV_BLOCKS full blocks (and the sliding blocks MAX_NUM_SEQS requests need), in bytes."""
    model = load_model(tiny)
    sliding = sliding_blocks_needed(model.config.window_past(MAX_MODEL_LEN), model.config.canvas_length, 16,
                                    MAX_NUM_SEQS, EngineConfig.max_prefill_tokens)
    return str(sliding_bytes_per_block(model, 16) * sliding + cache_bytes_per_block(model, 16) * KV_BLOCKS)


server = serve(
    fixture_value("tiny"), "--served-model-name", MODEL, "--api-key", KEY, "--max-denoising-steps", str(STEPS),
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
    "--kv-cache-memory", fixture_value("tiny", _kv_bytes), "--max-queued-requests", "64", "--max-request-size", "256KiB",
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny):
    with LLM(tiny) as llm:
        yield llm


def _auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_denoising_steps=STEPS, **kw)


def _usage(out, cached: int | None = None) -> dict:
    """The usage the server must report for one offline RequestOutput (`cached`: the prompt tokens
    the server found cached, if it served the same prompt before)."""
    m = out.metrics
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens if cached is None else cached},
        "diffusion": {k: m[k] for k in ("canvases", "denoising_steps", "canvas_positions_evaluated")},
    }


def test_health_models_and_metrics(server, tiny):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(server.url + "/v1/models", headers=_auth()).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # The checkpoint's directory by its name, not the server's path to it
    assert models["data"][0]["root"] == os.path.basename(tiny) and os.path.dirname(tiny) not in json.dumps(models)
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    m = server.metrics()
    [info] = [s for s in m.samples if s.name == "vllm:cache_config_info"]
    assert info.labels["num_gpu_blocks"] == str(KV_BLOCKS)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "blockdiff:step_duration_seconds_count", "blockdiff:canvases_total",
                 "vllm:diffusion_num_denoising_steps_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert any(s.name == name for s in m.samples), name


def test_vllm_ping_and_version(server):
    """vLLM's /ping is /health under another name (GET and POST, open without the key, for probes);
    /version answers vLLM's shape and, like the other paths, wants the key."""
    from blockdiff import __version__

    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping", timeout=10)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
    assert httpx.get(server.url + "/version", timeout=10).status_code == 401
    assert httpx.get(server.url + "/version", headers=_auth(), timeout=10).json() == {"version": __version__}


def test_completion_matches_offline(client, offline):
    prompt = "The quick brown fox"
    [want] = offline.generate(prompt, _params(max_tokens=20, seed=11), use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, seed=11, extra_body={"return_token_ids": True})
    [choice] = r.choices
    assert choice.token_ids == want.token_ids
    assert choice.text == want.text
    assert choice.finish_reason == want.finish_reason
    assert r.usage.model_dump(exclude_none=True) == _usage(want)
    assert want.metrics["canvases"] >= 2


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    """The second of two requests sharing a 40-token prompt finds its two full blocks of 16 cached:
    `usage.prompt_tokens_details.cached_tokens` and the prefix-cache counters say so, and the tokens
    are the same."""
    prompt = [(7 * i) % 250 + 20 for i in range(40)]
    before = server.metrics()
    runs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, seed=5,
                                      extra_body={"return_token_ids": True}) for _ in range(2)]
    after = server.metrics()
    assert [r.usage.prompt_tokens_details.cached_tokens for r in runs] == [0, 32]
    assert runs[0].choices[0].token_ids == runs[1].choices[0].token_ids
    delta = {k: after.total(k) - before.total(k) for k in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
    assert delta == {"vllm:prefix_cache_queries_total": 80, "vllm:prefix_cache_hits_total": 32}
    assert any(s.name == "vllm:num_preemptions_total" for s in after.samples)


def test_completion_stream_one_chunk_per_canvas(client, offline):
    prompt = [5, 17, 42, 99, 7]
    [want] = offline.generate(prompt, _params(max_tokens=28, seed=4, ignore_eos=True), use_tqdm=False)
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=28, seed=4, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    ))
    content, last = chunks[:-1], chunks[-1]
    assert len(content) == want.metrics["canvases"] == 4
    assert "".join(c.choices[0].text for c in content) == want.text
    assert [t for c in content for t in c.choices[0].token_ids] == want.token_ids
    assert [c.choices[0].finish_reason for c in content] == [None, None, None, "length"]
    assert last.choices == [] and last.usage.model_dump(exclude_none=True) == _usage(want)


def test_chat_matches_offline(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you?"}]
    [want] = offline.chat(messages, _params(max_tokens=16, seed=8), use_tqdm=False)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, seed=8,
                                       extra_body={"return_token_ids": True})
    [choice] = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.token_ids == want.token_ids
    assert choice.finish_reason == want.finish_reason
    assert r.usage.model_dump(exclude_none=True) == _usage(want)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert len(content) == want.metrics["canvases"]
    assert "".join(c.choices[0].delta.content for c in content) == want.text
    assert content[-1].choices[0].finish_reason == want.finish_reason
    # The same prompt again: its full blocks of 16 are cached now.
    assert chunks[-1].usage.model_dump(exclude_none=True) == _usage(want, len(want.prompt_token_ids) // 16 * 16)


def test_stream_holds_back_text_a_stop_string_may_cut(client, offline):
    """A stop string that starts in one canvas and ends in the next: the first chunk must not have
    sent its first character already."""
    base = dict(model=MODEL, prompt="The lazy dog", max_tokens=24, seed=21, stream=True,
                extra_body={"ignore_eos": True})
    plain = [c.choices[0].text for c in client.completions.create(**base)]
    full, boundary = "".join(plain), len(plain[0])
    stop = next((full[boundary - 1 : boundary - 1 + k] for k in range(2, 6)
                 if full.find(full[boundary - 1 : boundary - 1 + k]) == boundary - 1), None)
    assert stop is not None and len(plain) >= 2
    chunks = [c.choices[0] for c in client.completions.create(**base, stop=[stop])]
    [want] = offline.generate("The lazy dog", _params(max_tokens=24, seed=21, ignore_eos=True, stop=[stop]),
                              use_tqdm=False)
    assert want.text == full[: boundary - 1]
    assert "".join(c.text for c in chunks) == want.text
    assert [c.finish_reason for c in chunks] == [None, "stop"]

    # Logprob offsets run over the token strings, whatever text is held back.
    streamed = [c.choices[0].logprobs for c in client.completions.create(**base, stop=[stop], logprobs=0)]
    whole = client.completions.create(**{**base, "stream": False}, stop=[stop], logprobs=0).choices[0].logprobs
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [o for lp in streamed for o in lp.text_offset] == whole.text_offset
    assert whole.text_offset == [sum(map(len, whole.tokens[:i])) for i in range(len(whole.tokens))]


def test_n_and_prompt_lists(client, offline):
    """Choice i of a prompt is seeded with seed + i; choices are numbered prompt-major."""
    prompts = ["Hello", "The lazy dog"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, seed=5, max_tokens=12,
                                  extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    wants = [offline.generate(p, _params(max_tokens=12, seed=5 + i), use_tqdm=False)[0] for p in prompts for i in range(2)]
    assert [c.token_ids for c in r.choices] == [w.token_ids for w in wants]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in wants)
    assert r.usage.prompt_tokens == len(wants[0].prompt_token_ids) + len(wants[2].prompt_token_ids)


def test_logprobs(client, offline):
    [want] = offline.generate("Numbers such as", _params(max_tokens=10, seed=2, logprobs=2), use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt="Numbers such as", max_tokens=10, seed=2, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.outputs[0].token_logprobs], abs=1e-5)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == len(want.token_ids)
    assert all(1 <= len(top) <= 2 and max(top.values()) <= 1e-6 for top in lp.top_logprobs)

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Numbers"}], max_tokens=10,
                                          seed=2, logprobs=True, top_logprobs=3)
    [want] = offline.chat([{"role": "user", "content": "Numbers"}], _params(max_tokens=10, seed=2, logprobs=3),
                          use_tqdm=False)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in want.outputs[0].token_logprobs], abs=1e-5)
    for c, w in zip(content, want.outputs[0].token_logprobs):
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(list(w.top.values()), abs=1e-5)
        assert bytes(c.bytes).decode() == c.token


def test_greedy_logprobs_are_the_models_own(client):
    """At temperature 0 the alternatives are real log-probabilities (--logprobs-mode raw_logprobs,
    vLLM's default), not those of the greedy schedule's distribution (about -1e6 and below)."""
    r = client.completions.create(model=MODEL, prompt="Numbers such as", max_tokens=8, seed=2, temperature=0, logprobs=5)
    tops = r.choices[0].logprobs.top_logprobs
    assert len(tops) == 8
    for top in tops:  # keyed by text: tokens that decode alike share one entry
        assert 1 <= len(top) <= 5 and min(top.values()) > -50 and sum(math.exp(v) for v in top.values()) <= 1 + 1e-6


def test_temperature_scales_the_schedule(client, offline):
    """temperature multiplies t_min and t_max; 0 is greedy (the schedule scaled by 1e-6)."""
    d = offline.engine.defaults
    base = dict(model=MODEL, prompt="Hello", max_tokens=16, seed=3)
    scaled = client.completions.create(**base, temperature=0.5, extra_body={"return_token_ids": True})
    explicit = client.completions.create(**base, extra_body={"return_token_ids": True, "t_min": d["t_min"] * 0.5,
                                                             "t_max": d["t_max"] * 0.5})
    assert scaled.choices[0].token_ids == explicit.choices[0].token_ids
    greedy = client.completions.create(**base, temperature=0, extra_body={"return_token_ids": True})
    [want] = offline.generate("Hello", _params(max_tokens=16, seed=3, t_min=d["t_min"] * 1e-6, t_max=d["t_max"] * 1e-6),
                              use_tqdm=False)
    assert greedy.choices[0].token_ids == want.token_ids


def _sse_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    events, event = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((event, line[len("data: "):]))
            event = None
    return events


def test_stream_drafts(server, client, offline):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 20, "seed": 6, "stream": True, "stream_drafts": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200
        events = _sse_events(r)
    assert events[-1] == (None, "[DONE]")
    drafts = [json.loads(d) for e, d in events if e == "draft"]
    chunks = [json.loads(d) for e, d in events[:-1] if e is None]
    [want] = offline.generate("Hello", _params(max_tokens=20, seed=6), use_tqdm=False)
    # Drafts are extra events; the committed text is unchanged.
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert len(chunks) == want.metrics["canvases"]
    assert drafts and all(d["object"] == "text_completion.draft" for d in drafts)
    for d in drafts:
        [choice] = d["choices"]
        assert len(choice["token_ids"]) == offline.engine.canvas_length
        assert 0 <= choice["canvas"] < want.metrics["canvases"]
    # Every denoising step that did not end its canvas produced a draft.
    assert len(drafts) == want.metrics["denoising_steps"] - want.metrics["canvases"]

    # The openai client passes drafts through as chunks whose `object` names them.
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, seed=6, stream=True,
                                       extra_body={"stream_drafts": True})
    kinds = [c.object for c in stream]
    assert kinds.count("text_completion.draft") == len(drafts)
    assert kinds.count("text_completion") == len(chunks)


def _case(i: int) -> dict:
    """32 different requests: prompt kinds, lengths, stop strings, step counts, chat, streaming."""
    texts = ["Hello", "The quick brown fox", "Numbers such as 1 2 3", "Block diffusion", "How are you today?"]
    case = {"seed": 100 + i, "max_tokens": 6 + (7 * i) % 27, "stream": i % 2 == 1, "chat": i % 4 == 3, "extra": {}}
    if case["chat"]:
        case["messages"] = [{"role": "user", "content": texts[i % 5]}]
    else:
        case["prompt"] = texts[i % 5] if i % 3 else [3 + (i * 13 + k * 7) % 290 for k in range(3 + i % 9)]
    if i % 5 == 0:
        case["stop"] = ["e"]
    if i % 3 == 0:
        case["extra"]["max_denoising_steps"] = 2
    return case


async def _run_case(client: openai.AsyncOpenAI, case: dict) -> tuple[str, list[int], str]:
    kw = dict(model=MODEL, max_tokens=case["max_tokens"], seed=case["seed"], stop=case.get("stop"),
              stream=case["stream"], extra_body={"return_token_ids": True, **case["extra"]})
    api = client.chat.completions if case["chat"] else client.completions
    args = {"messages": case["messages"]} if case["chat"] else {"prompt": case["prompt"]}
    r = await api.create(**args, **kw)
    chunks = [c async for c in r] if case["stream"] else [r]
    text, ids, reason = "", [], None
    for c in chunks:
        for choice in c.choices:
            part = choice.delta.content if case["stream"] and case["chat"] else (
                choice.message.content if case["chat"] else choice.text)
            text += part or ""
            ids += choice.token_ids or []
            reason = choice.finish_reason or reason
    return text, ids, reason


def test_concurrent_requests_equal_requests_alone(server):
    """32 requests, 16 at a time, with fewer slots (8) and KV blocks than they need at once: all
    complete, each exactly as when it ran alone."""
    cases = [_case(i) for i in range(32)]

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            alone = [await _run_case(client, c) for c in cases]
            gate = asyncio.Semaphore(16)

            async def limited(c):
                async with gate:
                    return await _run_case(client, c)

            together = await asyncio.gather(*(limited(c) for c in cases))
            return alone, together

    alone, together = asyncio.run(main())
    assert all(ids for _, ids, _ in alone)
    assert all(reason in ("stop", "length") for _, _, reason in alone)
    assert together == alone
    m = server.wait_idle()
    assert m.total("vllm:num_requests_running") == 0 and m.total("vllm:kv_cache_usage_perc") == 0


def test_client_hangup_frees_its_request(server):
    long = {"model": MODEL, "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "max_denoising_steps": 16}
    before = server.wait_idle()

    # Streaming: hang up after the first canvas.
    with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, headers=_auth(),
                      timeout=60) as r:
        lines = r.iter_lines()  # kept: closing this iterator would close the connection
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        busy = server.metrics()
        assert busy.total("vllm:num_requests_running") == 1 and busy.total("vllm:kv_cache_usage_perc") > 0, (first, busy)
    # Non-streaming: the client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=long, headers=_auth(), timeout=1.0)

    after = server.wait_idle()
    assert after.total("vllm:num_requests_running") == 0 and after.total("vllm:kv_cache_usage_perc") == 0
    def ended(m, reason):
        return m.total("vllm:request_success_total", finished_reason=reason)

    assert ended(after, "abort") == ended(before, "abort") + 2
    assert ended(after, "length") == ended(before, "length")


# ---- bad input ----------------------------------------------------------------------------------
_C = "/v1/completions"
_CHAT = "/v1/chat/completions"
_OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
_MSG = [{"role": "user", "content": "Hi"}]
BAD = [
    # (name, path, body (dict, or bytes sent as-is), headers, status, param)
    ("malformed json", _C, b'{"prompt": "Hello", ', None, 400, None),
    ("body is a list", _C, b"[1, 2]", None, 400, None),
    ("empty body", _C, b"", None, 400, None),
    ("prompt wrong type", _C, {"prompt": 5}, None, 400, "prompt"),
    ("prompt mixed list", _C, {"prompt": [1, "a"]}, None, 400, "prompt"),
    ("max_tokens string", _C, {**_OK, "max_tokens": "10"}, None, 400, "max_tokens"),
    ("max_tokens bool", _C, {**_OK, "max_tokens": True}, None, 400, "max_tokens"),
    ("stream string", _C, {**_OK, "stream": "yes"}, None, 400, "stream"),
    ("seed float", _C, {**_OK, "seed": 1.5}, None, 400, "seed"),
    ("stop number", _C, {**_OK, "stop": 5}, None, 400, "stop"),
    ("negative max_tokens", _C, {**_OK, "max_tokens": -1}, None, 400, "max_tokens"),
    ("zero max_tokens", _C, {**_OK, "max_tokens": 0}, None, 400, "max_tokens"),
    ("huge max_tokens", _C, {**_OK, "max_tokens": 10**12}, None, 400, "max_tokens"),
    ("max_tokens over the context", _C, {**_OK, "max_tokens": 100000}, None, 400, "max_tokens"),
    ("seed over 64 bits", _C, {**_OK, "seed": 2**70}, None, 400, "seed"),
    ("unknown model", _C, {**_OK, "model": "gpt-4"}, None, 404, "model"),
    ("out-of-vocab prompt ids", _C, {**_OK, "prompt": [1, 2, 100000]}, None, 400, "prompt"),
    ("negative prompt id", _C, {**_OK, "prompt": [1, -3]}, None, 400, "prompt"),
    ("empty prompt", _C, {**_OK, "prompt": []}, None, 400, "prompt"),
    ("over-long id prompt", _C, {**_OK, "prompt": [5] * 300}, None, 400, "prompt"),
    ("over-long text prompt", _C, {**_OK, "prompt": "Hello world " * 200}, None, 400, "prompt"),
    ("t_max below t_min", _C, {**_OK, "t_min": 0.9, "t_max": 0.1}, None, 400, "t_max"),
    ("zero entropy_bound", _C, {**_OK, "entropy_bound": 0}, None, 400, "entropy_bound"),
    ("zero denoising steps", _C, {**_OK, "max_denoising_steps": 0}, None, 400, "max_denoising_steps"),
    ("negative confidence", _C, {**_OK, "confidence_threshold": -1.0}, None, 400, "confidence_threshold"),
    ("negative stability", _C, {**_OK, "stability_threshold": -1}, None, 400, "stability_threshold"),
    ("out-of-vocab draft", _C, {**_OK, "draft": [1, 99999]}, None, 400, "draft"),
    ("draft wrong type", _C, {**_OK, "draft": ["a"]}, None, 400, "draft"),
    ("top_p over 1", _C, {**_OK, "top_p": 1.5}, None, 400, "top_p"),
    ("top_k below -1", _C, {**_OK, "top_k": -2}, None, 400, "top_k"),
    ("negative min_p", _C, {**_OK, "min_p": -0.5}, None, 400, "min_p"),
    ("negative temperature", _C, {**_OK, "temperature": -1.0}, None, 400, "temperature"),
    ("n zero", _C, {**_OK, "n": 0}, None, 400, "n"),
    ("n over 128", _C, {**_OK, "n": 129}, None, 400, "n"),
    ("n huge", _C, {"prompt": [5, 6, 7], "n": 200_000, "max_tokens": 1}, None, 400, "n"),
    ("prompts x n over 2048", _C, {**_OK, "prompt": [[5, 6]] * 17, "n": 128}, None, 400, "n"),
    ("over 2048 prompts", _C, {**_OK, "prompt": ["a"] * 2049}, None, 400, "prompt"),
    ("chat n over 128", _CHAT, {"model": MODEL, "messages": _MSG, "n": 1000}, None, 400, "n"),
    ("too many logprobs", _C, {**_OK, "logprobs": 21}, None, 400, "logprobs"),
    ("suffix", _C, {**_OK, "suffix": "x"}, None, 400, "suffix"),
    ("max_tokens zero without echo", _C, {**_OK, "max_tokens": 0}, None, 400, "max_tokens"),
    ("logit_bias over 100", _C, {**_OK, "logit_bias": {"5": 100.5}}, None, 400, "logit_bias"),
    ("logit_bias outside the vocabulary", _C, {**_OK, "logit_bias": {"1000000": 1.0}}, None, 400, "logit_bias"),
    ("logit_bias key not an id", _C, {**_OK, "logit_bias": {"a": 1.0}}, None, 400, "logit_bias"),
    ("logit_bias over 300 tokens", _C, {**_OK, "logit_bias": {str(i): 1.0 for i in range(301)}}, None, 400, "logit_bias"),
    ("presence_penalty over 2", _C, {**_OK, "presence_penalty": 2.5}, None, 400, "presence_penalty"),
    ("frequency_penalty below -2", _C, {**_OK, "frequency_penalty": -2.5}, None, 400, "frequency_penalty"),
    ("repetition_penalty zero", _C, {**_OK, "repetition_penalty": 0.0}, None, 400, "repetition_penalty"),
    ("drafts without stream", _C, {**_OK, "stream_drafts": True}, None, 400, "stream_drafts"),
    ("stream_options without stream", _C, {**_OK, "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    ("chat messages empty", _CHAT, {"model": MODEL, "messages": []}, None, 400, "messages"),
    ("chat messages string", _CHAT, {"model": MODEL, "messages": "Hi"}, None, 400, "messages"),
    ("chat unknown role", _CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, None, 400, "messages"),
    ("chat image part", _CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, None, 400, "messages"),
    ("chat top_logprobs alone", _CHAT, {"model": MODEL, "messages": _MSG, "top_logprobs": 2}, None, 400, "top_logprobs"),
    ("chat huge max_completion_tokens", _CHAT, {"model": MODEL, "messages": _MSG, "max_completion_tokens": 10**9},
     None, 400, "max_completion_tokens"),
    ("chat zero max_completion_tokens", _CHAT, {"model": MODEL, "messages": _MSG, "max_completion_tokens": 0},
     None, 400, "max_completion_tokens"),
    ("chat zero max_tokens", _CHAT, {"model": MODEL, "messages": _MSG, "max_tokens": 0}, None, 400, "max_tokens"),
    ("chat t_max below t_min", _CHAT, {"model": MODEL, "messages": _MSG, "t_min": 0.9, "t_max": 0.1}, None, 400, "t_max"),
    # Values the engine could not represent once failed it for everyone.
    ("stability over int64", _C, {**_OK, "stability_threshold": 2**63}, None, 400, "stability_threshold"),
    ("steps over int32", _C, {**_OK, "max_denoising_steps": 2**31}, None, 400, "max_denoising_steps"),
    ("steps over the server limit", _C, {**_OK, "max_denoising_steps": 10**9, "stability_threshold": 10**9}, None, 400,
     "max_denoising_steps"),
    ("temperature underflows", _C, {**_OK, "temperature": 1e-300}, None, 400, "temperature"),
    ("temperature overflows", _C, {**_OK, "temperature": 1e300}, None, 400, "temperature"),
    ("t_max over float32", _C, {**_OK, "t_max": 3.5e38}, None, 400, "t_max"),
    ("subnormal schedule", _C, {**_OK, "t_min": 0, "t_max": 1e-46}, None, 400, "t_min"),
    ("cost over the limit", _C, {**_OK, "n": 128, "max_tokens": 200, "ignore_eos": True}, None, 400, "max_tokens"),
    ("wrong api key", _C, _OK, {"Authorization": "Bearer nope"}, 401, None),
    ("missing api key", _C, _OK, {"Authorization": ""}, 401, None),
    ("body over the size limit", _C, {**_OK, "prompt": "x" * 300_000}, None, 413, None),
    ("more queued than allowed", _C, {**_OK, "n": MAX_NUM_SEQS + 65}, None, 429, None),  # 8 start, 65 > 64 wait
    ("unknown endpoint", "/v1/embeddings", _OK, None, 404, None),
]


@pytest.mark.parametrize("name,path,body,headers,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server, name, path, body, headers, status, param):
    h = {**_auth(), "Content-Type": "application/json", **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers=h, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_text_too_long_to_fit_is_refused_before_tokenizing(server, offline):
    """Text longer than max_model_len x the longest token's characters cannot fit; the server says
    so from its length (tokenizing megabytes would hold the GIL and stall every other request)."""
    limit = MAX_MODEL_LEN * offline.engine.tokenizer.max_token_chars
    for path, body in [(_C, {**_OK, "prompt": "x" * (limit + 1)}),
                       (_C, {**_OK, "prompt": ["Hello", "y" * (limit + 1)]}),
                       (_CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "z" * (limit // 2)},
                                                   {"role": "user", "content": "z" * (limit - limit // 2 + 1)}]})]:
        r = httpx.post(server.url + path, json=body, headers=_auth(), timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == ("messages" if path == _CHAT else "prompt")
        # The chat counts its roles too (10 characters here): all the text the template reads.
        chars = limit + 1 + (10 if path == _CHAT else 0)
        assert f"{chars} characters" in error["message"] and f"cannot fit in max_model_len={MAX_MODEL_LEN}" in error["message"], error


def test_queue_limit_counts_only_requests_that_would_wait(tiny, tmp_path):
    """--max-queued-requests 0: what a free slot takes right away is served; what would wait is a 429."""
    server = ServerProcess(tiny, "--served-model-name", MODEL, "--max-num-seqs", "1", "--max-queued-requests", "0", "--max-model-len", str(MAX_MODEL_LEN),
                           log_path=str(tmp_path / "server.log"))
    try:
        r = httpx.post(server.url + _C, json=_OK, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(server.url + _C, json={**_OK, "n": 2}, timeout=60).status_code == 429  # one of two would wait
        long = {**_OK, "max_tokens": 240, "ignore_eos": True, "max_denoising_steps": 16, "stream": True}
        with httpx.stream("POST", server.url + _C, json=long, timeout=60) as busy:
            lines = busy.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # it holds the only slot
            r = httpx.post(server.url + _C, json=_OK, timeout=60)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    finally:
        server.close()


def test_streamed_body_over_the_limit(server):
    chunks = (b"x" * 65536 for _ in range(5))  # chunked transfer: no Content-Length to check up front
    r = httpx.post(server.url + _C, content=chunks, headers={**_auth(), "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=10**9)
    assert "max_model_len" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("modality", ["image", "video"])
def test_media_on_a_text_model_is_a_400_coded_by_its_modality(server, modality):
    part = {"type": f"{modality}_url", f"{modality}_url": {"url": f"data:{modality}/png;base64,AAAA"}}
    r = httpx.post(server.url + _CHAT, headers=_auth(), timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, part]}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == f"invalid_{modality}" and f"does not take {modality}s" in error["message"], error


def test_serves_after_bad_input(server, client):
    m = server.wait_idle()
    assert m.total("vllm:num_requests_running") == 0 and m.total("vllm:num_requests_waiting") == 0
    assert m['blockdiff:http_responses_total{status="400"}'] >= sum(1 for b in BAD if b[4] == 400)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
