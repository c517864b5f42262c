"""What tools written for a vLLM server send to blockdiff's: /tokenize and /detokenize, the exact
requests of `vllm bench serve`, and vLLM's metric names. A real server on the demo checkpoint."""

from __future__ import annotations

import json
import re

from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from server_process import serve

from blockdiff.engine.client import EngineStats
from blockdiff.entrypoints.openai.metrics import ServingMetrics

CHAT = [{"role": "user", "content": "sort: 3 1 2"}]


server = serve(None, "--max-model-len", "256")


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
    (tests/server/test_ecosystem_clients.py serves it)."""
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
    assert _post(server, "/v1/completions", {**completion, "repetition_penalty": 1.2}).status_code == 200
    refused = _post(server, "/v1/completions", {**completion, "repetition_penalty": -1.0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "repetition_penalty"


# Every family /metrics has: vLLM's names, and blockdiff's own for what vLLM has no name for; no
# event is counted under two names.
VLLM_FAMILIES = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:num_preemptions", "vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:diffusion_num_denoising_steps", "vllm:diffusion_num_canvas_positions",
                 "vllm:diffusion_num_committed_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"}
BLOCKDIFF_FAMILIES = {"blockdiff:canvases", "blockdiff:step_duration_seconds", "blockdiff:http_responses"}
BLOCKDIFF_REFUSALS = {"blockdiff:http_refusals", "blockdiff:connections_closed"}  # there once one happened
# One observation per ended request.
PER_REQUEST = ["vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
               "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
               "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"]


def test_metrics_count_each_event_once_under_vllms_names(server):
    before = server.wait_idle()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    outs = [client.completions.create(model="demo", prompt=prompt, max_tokens=24, seed=1, extra_body={"ignore_eos": True})
            for prompt in ("reverse: diffusion", "upper: canvas")]
    after = server.wait_idle()
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    # prometheus_client writes each counter's and histogram's creation time as a family of its own.
    families = {f.name for f in text_string_to_metric_families(r.text) if not f.name.endswith("_created")}
    assert VLLM_FAMILIES | BLOCKDIFF_FAMILIES <= families <= VLLM_FAMILIES | BLOCKDIFF_FAMILIES | BLOCKDIFF_REFUSALS

    def grew(name: str, **labels: str) -> float:
        return after.total(name, model_name="demo", engine="0", **labels) - before.total(name, **labels)

    usage = {k: sum(getattr(o.usage, k) for o in outs) for k in ("prompt_tokens", "completion_tokens")}
    diffusion = {k: sum(o.usage.diffusion[k] for o in outs)
                 for k in ("canvases", "denoising_steps", "canvas_positions_evaluated")}
    assert grew("vllm:request_success_total") == grew("vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert grew("vllm:generation_tokens_total") == grew("vllm:diffusion_num_committed_tokens_total") == \
        usage["completion_tokens"] == 48
    assert grew("vllm:diffusion_num_denoising_steps_total") == diffusion["denoising_steps"]
    assert grew("vllm:diffusion_num_canvas_positions_total") == diffusion["canvas_positions_evaluated"]
    assert after.total("blockdiff:canvases_total") - before.total("blockdiff:canvases_total") == diffusion["canvases"]
    for name in PER_REQUEST:
        assert grew(name + "_count") == 2, name
        assert after.total(name + "_bucket", le="+Inf") == after.total(name + "_count"), name
    # A diffusion model's "token" latency is a canvas's: one gap between consecutive canvases.
    assert grew("vllm:inter_token_latency_seconds_count") == diffusion["canvases"] - 2
    assert grew("vllm:request_generation_tokens_sum") == 48
    assert after.total("vllm:num_requests_running") == after.total("vllm:num_requests_waiting") == 0
    [info] = [s for s in after.samples if s.name == "vllm:cache_config_info"]
    assert info.labels["model_name"] == "demo" and info.labels["block_size"] == "16" and info.value == 1


def test_each_server_has_its_own_registry():
    """Two servers in one process (tests build several apps) count apart, and neither in the global registry."""
    stats = EngineStats(0, 0, 4, 0.0, 64, 0, 0, 0, 16, True, 64, "")
    client = SimpleNamespace(engine_stats=lambda: {"0": stats}, limits=SimpleNamespace(max_model_len=256))
    one, two = ServingMetrics(client, "demo"), ServingMetrics(client, "demo")
    one.response(200)
    assert 'blockdiff:http_responses_total{status="200"} 1.0' in one.render().decode()
    assert "blockdiff:http_responses_total{" not in two.render().decode()
    assert not any(f.name.startswith(("vllm:", "blockdiff:")) for f in REGISTRY.collect())


# The demo's tokenizer (with Gemma 4's tool and thinking markers, so its chats are parsed) on
# random weights: a model that writes special tokens often.
random_demo = serve(None, "--load-format", "dummy", "--max-model-len", "256")


@pytest.mark.slow  # ~12 s on 2 cores
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
