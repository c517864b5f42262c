"""What tools written for a vLLM server send to blockdiff's: /tokenize and /detokenize, the exact
requests of `vllm bench serve`, and vLLM's metric names. A real server on the demo checkpoint."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_process import ServerProcess

CHAT = [{"role": "user", "content": "sort: 3 1 2"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(None, "--max-model-len", "256", log_path=str(tmp_path_factory.mktemp("vllm") / "server.log"))
    yield proc
    proc.close()


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def test_tokenize_and_detokenize_round_trip_a_prompt(server):
    plain = _post(server, "/tokenize", {"model": "demo", "prompt": "reverse: block", "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert plain["count"] == len(plain["tokens"]) > 0 and plain["max_model_len"] == 256
    assert "".join(plain["token_strs"]) == "reverse: block"  # the demo's vocabulary is one character a token
    assert _post(server, "/detokenize", {"model": "demo", "tokens": plain["tokens"]}).json() == {"prompt": "reverse: block"}
    special = _post(server, "/tokenize", {"prompt": "reverse: block"}).json()  # add_special_tokens defaults to true
    assert special["tokens"] == [2, *plain["tokens"]] and special["token_strs"] is None
    assert _post(server, "/detokenize", {"tokens": special["tokens"]}).json()["prompt"] == "<bos>reverse: block"


def test_tokenizer_info_is_off_without_vllms_flag(server):
    """It shows the chat template: served only with --enable-tokenizer-info-endpoint, as vLLM
    (tests/test_ecosystem_clients.py serves it)."""
    assert httpx.get(server.url + "/tokenizer_info", timeout=60).status_code == 404


def test_tokenize_messages_gives_the_ids_the_chat_endpoint_prompts_with(server):
    ids = _post(server, "/tokenize", {"model": "demo", "messages": CHAT}).json()["tokens"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    answer = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=8, seed=0)
    assert answer.usage.prompt_tokens == len(ids) and answer.choices[0].message.content == "1 2 3"
    bare = _post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert len(bare) < len(ids) and ids[:len(bare)] == bare
    text = _post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.startswith("<bos>") and "sort: 3 1 2" in text


def test_tokenize_messages_with_tools_counts_what_the_chat_endpoint_prompts_with(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    count = _post(server, "/tokenize", {"messages": CHAT, "tools": tools}).json()["count"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    answer = client.chat.completions.create(model="demo", messages=CHAT, tools=tools, max_tokens=8, seed=0)
    assert answer.usage.prompt_tokens == count
    r = _post(server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"no_such_variable": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    assert "no_such_variable" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [5, 100000]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "1 2 3"}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/tokenize", {"prompt": 17}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {}, "messages"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, "messages"),
    ("/tokenize", {"prompt": "a", "tools": []}, "tools"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "tokens": [1]}, "tokens"),
])
def test_bad_tokenizer_requests_get_a_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert _post(server, "/tokenize", {"prompt": "ok"}).status_code == 200  # still up


def test_a_refused_request_logs_its_reason_at_info(server):
    """The server's log says why a request got its 400 (uvicorn's access line has only the status)."""
    r = _post(server, "/v1/completions", {"model": "demo", "prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    r = _post(server, "/v1/completions", {"model": "demo", "prompt": "a", "max_tokens": "many"})
    assert r.status_code == 400
    log = server.log()
    assert "INFO blockdiff.entrypoints.openai.errors: POST /v1/completions -> 400: suffix is not supported (param: suffix)" in log
    assert "-> 400: max_tokens: Input should be a valid integer" in log


def test_tokenize_with_an_unknown_model_is_a_404(server):
    r = _post(server, "/tokenize", {"model": "gpt-4", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def _sse(r: httpx.Response) -> list[dict]:
    events = [line.removeprefix("data:").strip() for line in r.text.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_the_requests_of_vllm_bench_serve_are_served(server):
    """The calls of vLLM's `vllm bench serve` (vllm/benchmarks/serve.py and lib/endpoint_request_func.py),
    field for field: the model from /v1/models, then streamed completions and chat completions with
    its payloads (repetition_penalty 1.0, logprobs null, temperature 0 by default, ignore_eos for
    the random dataset) and its x-request-id header."""
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    assert model == "demo"
    extra = {"temperature": 0.0}
    completion = {"model": model, "prompt": "upper: diffusion", "repetition_penalty": 1.0, "max_tokens": 16,
                  "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}
    r = _post(server, "/v1/completions", completion, headers={"x-request-id": "bench-1234-0"})
    assert r.status_code == 200, r.text
    chunks = _sse(r)
    assert any(c["choices"] and c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    chat = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": "sort: 3 1 2"}]}],
            "max_completion_tokens": 16, "stream": True, "stream_options": {"include_usage": True}, **extra}
    r = _post(server, "/v1/chat/completions", chat, headers={"x-request-id": "bench-1234-1"})
    assert r.status_code == 200, r.text
    chunks = _sse(r)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "1 2 3"
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    refused = _post(server, "/v1/completions", {**completion, "repetition_penalty": 1.2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "repetition_penalty"


VLLM_COUNTERS = ["vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:diffusion_num_denoising_steps_total",
                 "vllm:diffusion_num_canvas_positions_total", "vllm:diffusion_num_committed_tokens_total",
                 "vllm:prefix_cache_queries_total"]
VLLM_HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                   "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                   "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]


def test_vllm_metric_names_are_reported_beside_ours_and_increase(server):
    label = '{model_name="demo",engine="0"}'
    before = server.wait_idle()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert name + label in before
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.completions.create(model="demo", prompt="reverse: diffusion", max_tokens=24, seed=1,
                                    extra_body={"ignore_eos": True})
    after = server.wait_idle()
    for name in VLLM_COUNTERS:
        assert after[name + label] > before[name + label], name
    for name in VLLM_HISTOGRAMS:
        assert after[f"{name}_count{label}"] > before[f"{name}_count{label}"], name
        assert after[f'{name}_bucket{{model_name="demo",engine="0",le="+Inf"}}'] == after[f"{name}_count{label}"]
    success = 'vllm:request_success_total{model_name="demo",engine="0",finished_reason="length"}'
    assert after[success] == before[success] + 1
    # The aliases count what ours count.
    assert after["vllm:generation_tokens_total" + label] - before["vllm:generation_tokens_total" + label] == \
        out.usage.completion_tokens == 24
    assert after["vllm:diffusion_num_denoising_steps_total" + label] == after["blockdiff_denoising_steps_total"]
    canvases = after["blockdiff_canvases_total"] - before["blockdiff_canvases_total"]
    gaps = after["vllm:inter_token_latency_seconds_count" + label] - before["vllm:inter_token_latency_seconds_count" + label]
    assert canvases >= 3 and gaps == canvases - 1


@pytest.fixture(scope="module")
def random_demo(tmp_path_factory):
    """The demo's tokenizer (with Gemma 4's tool and thinking markers, so its chats are parsed) on
    random weights: a model that writes special tokens often."""
    proc = ServerProcess(None, "--load-format", "dummy", "--max-model-len", "256",
                         log_path=str(tmp_path_factory.mktemp("random_demo") / "server.log"))
    yield proc
    proc.close()


def test_a_parsed_chat_reply_carries_no_special_token_unless_asked(random_demo):
    """A chat with tools is decoded with its special tokens, for the parsers to read the markers;
    what they leave as text drops them (vLLM's skip_special_tokens, true by default), and keeps
    them with skip_special_tokens false."""
    client = openai.OpenAI(base_url=random_demo.url + "/v1", api_key="unused")
    tokens = _post(random_demo, "/tokenize", {"prompt": "<pad><eos><unk><|tool_call>"}).json()["tokens"]
    assert len(tokens) == 5  # <bos> and each marker one special token
    special = re.compile(r"<pad>|<eos>|<bos>|<unk>|<start_of_turn>|<end_of_turn>|<\|?[a-z_\"]+\|?>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    seen = 0
    for seed in range(8):
        body = dict(model="demo", messages=CHAT, tools=tools, max_tokens=24, seed=seed, temperature=1.0)
        kept = client.chat.completions.create(**body, extra_body={"skip_special_tokens": False}).choices[0].message
        dropped = client.chat.completions.create(**body).choices[0].message
        assert not special.search((dropped.content or "") + (getattr(dropped, "reasoning_content", None) or ""))
        if not kept.tool_calls and special.search(kept.content or ""):
            seen += 1
    assert seen  # the case happened: replies with special tokens in their text
