"""/v1/messages, Anthropic's Messages API, through the real server and the official `anthropic` SDK,
on the bundled demo model (which was taught sorting, the weather tool and thinking:
blockdiff/demo/tasks.py): messages created and streamed, a tool round trip, thinking blocks, stop
sequences, count_tokens against the chat endpoint's prompt_tokens, and errors in Anthropic's shape.
The SDK sends no temperature of its own any more: it goes in the extra body.
"""

from __future__ import annotations

import asyncio
import base64
import json

import anthropic
import httpx
import openai
import pytest
from server_process import serve

from blockdiff.demo.tasks import WEATHER_TOOL
from blockdiff.config import EngineConfig
from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.engine.engine import LLMEngine
from blockdiff.entrypoints.anthropic import protocol as a
from blockdiff.entrypoints.anthropic import serving
from blockdiff.entrypoints.anthropic.convert import chat_messages
from blockdiff.entrypoints.openai.config import ServerConfig
from blockdiff.entrypoints.openai.server import build_app

KEY = "sk-test"
GREEDY = dict(max_tokens=48, extra_body={"temperature": 0})
SORT = [{"role": "user", "content": "sort: 3 1 2"}]
WEATHER = [{"role": "user", "content": "weather in Paris"}]
TOOL = {"name": WEATHER_TOOL["function"]["name"], "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}
FORCED = {"type": "tool", "name": "get_weather"}
# The SDK's stream drops `ping` events (test_stream_sends_pings reads them off the wire).
STREAM_TYPES = ["message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
                "message_stop"]


server = serve(None, "--max-model-len", "512", "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def create(client, messages, **kw) -> anthropic.types.Message:
    return client.messages.create(model="demo", messages=messages, **{**GREEDY, **kw})


def raw_events(client, messages, **kw) -> list:
    return list(client.messages.create(model="demo", messages=messages, stream=True, **{**GREEDY, **kw}))


def _runs(types: list[str]) -> list[str]:
    """Event types with repeats in a row folded: the stream's shape, whatever its number of deltas."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_create_message(server, client, chat_client):
    r = create(client, SORT, metadata={"user_id": "user-1"},
               extra_body={"temperature": 0, "top_k": 1, "top_p": 0.9, "min_p": 0.1, "seed": 3, "max_denoising_steps": 8})
    assert "request fields ignored" not in server.log()  # every field above is one /v1/messages reads
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "demo"
    assert [(b.type, b.text) for b in r.content] == [("text", "1 2 3")]
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    chat = chat_client.chat.completions.create(model="demo", messages=SORT, max_tokens=48, temperature=0)
    assert chat.choices[0].message.content == "1 2 3"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_stream_events_and_text_equal_the_whole_message(client):
    whole = create(client, SORT)
    events = raw_events(client, SORT)
    assert _runs([e.type for e in events]) == STREAM_TYPES
    start, delta = events[0], events[-2]
    assert start.message.id.startswith("msg_") and start.message.content == [] and start.message.stop_reason is None
    assert start.message.usage.input_tokens == whole.usage.input_tokens
    assert (delta.delta.stop_reason, delta.usage.output_tokens) == ("end_turn", whole.usage.output_tokens)
    assert {e.index for e in events if e.type.startswith("content_block")} == {0}
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "1 2 3"
    with client.messages.stream(model="demo", messages=SORT, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens


def test_stream_wire_format_has_a_ping(server):
    """Each event is `event: TYPE` and a `data:` line whose type is TYPE, with a ping after message_start."""
    body = {"model": "demo", "messages": SORT, "max_tokens": 48, "temperature": 0, "stream": True}
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [block.split("\n") for block in r.text.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert all(json.loads(lines[1].removeprefix("data: "))["type"] == name for name, lines in zip(names, events))
    assert _runs(names) == [STREAM_TYPES[0], "ping", *STREAM_TYPES[1:]]


def test_tool_round_trip(client):
    """Forced, the reply is a tool_use block whose input the tool's schema allows; sent back with a
    tool_result, the answer is text that uses it."""
    r = create(client, WEATHER, tools=[TOOL], tool_choice=FORCED)
    [call] = r.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert call.id.startswith("toolu_") and r.stop_reason == "tool_use"
    turn = [*WEATHER, {"role": "assistant", "content": r.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C sunny"}]}]
    answer = create(client, turn, tools=[TOOL])
    assert [(b.type, b.text) for b in answer.content] == [("text", "Paris: 18C sunny")]
    assert answer.stop_reason == "end_turn"
    # The same with the result as text blocks, and the auto choice finding the call unforced.
    auto = create(client, WEATHER, tools=[TOOL], tool_choice={"type": "auto"})
    assert [b.input for b in auto.content] == [{"city": "Paris"}]
    turn[-1]["content"][0]["content"] = [{"type": "text", "text": "18C sunny"}]
    assert create(client, turn, tools=[TOOL]).content[0].text == "Paris: 18C sunny"


def test_any_tool_choice_and_structured_output(client):
    """tool_choice any forces a call, even for a question the demo answers in text; output_config.format
    constrains the text to its JSON schema."""
    r = create(client, SORT, tools=[TOOL], tool_choice={"type": "any"})
    assert [b.type for b in r.content] == ["tool_use"] and r.content[0].name == "get_weather" and r.stop_reason == "tool_use"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    r = create(client, SORT, output_config={"format": {"type": "json_schema", "schema": schema}})
    value = json.loads(r.content[0].text)
    assert list(value) == ["n"] and isinstance(value["n"], int)


def test_tool_use_streamed_as_input_json_delta(client):
    events = raw_events(client, WEATHER, tools=[TOOL], tool_choice=FORCED)
    assert _runs([e.type for e in events]) == STREAM_TYPES
    [start] = [e for e in events if e.type == "content_block_start"]
    assert (start.content_block.type, start.content_block.name, start.content_block.input) == ("tool_use", "get_weather", {})
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["input_json_delta"] and deltas[0].partial_json == '{"city": "Paris"}'
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(model="demo", messages=WEATHER, tools=[TOOL], tool_choice=FORCED, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]


def test_tool_choice_none_reads_no_call(client):
    r = create(client, WEATHER, tools=[TOOL], tool_choice={"type": "none"})
    assert [b.type for b in r.content] == ["text"] and "call:get_weather{" in r.content[0].text
    assert r.stop_reason == "end_turn"


def test_thinking_blocks(client):
    # Adaptive: an enabled budget must be 1,024 or more and below max_tokens, more than the demo's context.
    question = [{"role": "user", "content": "reverse: block"}]
    on = create(client, question, thinking={"type": "adaptive"})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in on.content] == [
        ("thinking", "I reverse the word."), ("text", "kcolb")]
    off = create(client, question, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in off.content] == [("text", "kcolb")]
    events = raw_events(client, question, thinking={"type": "adaptive"})
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert "".join(e.delta.thinking for e in deltas if e.delta.type == "thinking_delta") == "I reverse the word."
    assert "".join(e.delta.text for e in deltas if e.delta.type == "text_delta") == "kcolb"
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]


@pytest.mark.parametrize("budget, says", [
    (-1, "thinking.budget_tokens: Input should be greater than or equal to 1024"),
    (1023, "thinking.budget_tokens: Input should be greater than or equal to 1024"),
    (10**30, f"thinking.budget_tokens ({10**30}) must be less than max_tokens (48)"),
    (1024, "thinking.budget_tokens (1024) must be less than max_tokens (48)"),
])
def test_a_thinking_budget_out_of_anthropics_bounds_is_a_400(client, budget, says):
    with pytest.raises(anthropic.BadRequestError) as error:
        create(client, SORT, thinking={"type": "enabled", "budget_tokens": budget})
    assert error.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": says}}


def test_thinking_enabled_without_a_budget_is_a_400(client):
    """Anthropic requires budget_tokens with type "enabled" (adaptive thinking takes none)."""
    with pytest.raises(anthropic.BadRequestError) as error:
        create(client, SORT, thinking={"type": "enabled"})
    assert error.value.body["error"]["message"].startswith("thinking.budget_tokens: Field required")
    assert client.messages.count_tokens(model="demo", messages=SORT, thinking={"type": "adaptive"}).input_tokens > 0


def test_stop_sequences_and_max_tokens(client):
    r = create(client, SORT, stop_sequences=[" 3", " 2"])
    assert [b.text for b in r.content] == ["1"]
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", " 2")
    short = create(client, SORT, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_count_tokens_equals_the_chat_prompt(client, chat_client):
    def chat_prompt_tokens(messages, **kw) -> int:
        return chat_client.chat.completions.create(model="demo", messages=messages, max_tokens=1, **kw).usage.prompt_tokens

    plain = client.messages.count_tokens(model="demo", messages=SORT).input_tokens
    assert plain == chat_prompt_tokens(SORT)
    system = "You sort numbers."
    with_system = client.messages.count_tokens(model="demo", messages=SORT, system=system).input_tokens
    assert with_system > plain
    assert with_system == chat_prompt_tokens([{"role": "system", "content": system}, *SORT])
    assert client.messages.count_tokens(model="demo", messages=SORT, system=[{"type": "text", "text": system}]).input_tokens == with_system
    assert create(client, SORT, system=system).usage.input_tokens == with_system
    with_tool = client.messages.count_tokens(model="demo", messages=WEATHER, tools=[TOOL]).input_tokens
    assert with_tool == chat_prompt_tokens(WEATHER, tools=[WEATHER_TOOL])


def test_images_take_the_chat_endpoints_image_path(client, chat_client):
    """The demo has no vision tower: an image block, base64 or by URL, is refused as the chat
    endpoint refuses the same image_url part, with its message."""
    data = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()
    for source, url in (({"type": "base64", "media_type": "image/png", "data": data}, f"data:image/png;base64,{data}"),
                        ({"type": "url", "url": "https://example.com/cat.png"}, "https://example.com/cat.png")):
        with pytest.raises(openai.BadRequestError) as chat_error:
            chat_client.chat.completions.create(model="demo", max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}])
        with pytest.raises(anthropic.BadRequestError) as error:
            create(client, [{"role": "user", "content": [{"type": "image", "source": source},
                                                         {"type": "text", "text": "what is it?"}]}])
        assert error.value.body["error"]["message"] == chat_error.value.body["message"]


def test_errors_in_anthropics_shape_and_the_server_stays_up(server, client, chat_client):
    with pytest.raises(anthropic.BadRequestError) as error:  # the SDK will not send a request without max_tokens
        client.post("/v1/messages", body={"model": "demo", "messages": SORT}, cast_to=httpx.Response)
    assert error.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    cases = [
        (anthropic.BadRequestError, dict(max_tokens=0), "max_tokens"),
        (anthropic.BadRequestError, dict(tool_choice={"type": "any"}), "tool_choice needs tools"),
        (anthropic.BadRequestError, dict(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}), "'nope', which is not among"),
        (anthropic.BadRequestError, dict(stop_sequences=["x"] * 17), "stop_sequences"),
        (anthropic.NotFoundError, dict(model="claude-nope"), "model 'claude-nope' does not exist"),
    ]
    for kind, kw, message in cases:
        with pytest.raises(kind, match=message) as error:
            client.messages.create(**{"model": "demo", "messages": SORT, **GREEDY, **kw})
        assert error.value.body["type"] == "error" and set(error.value.body["error"]) == {"type", "message"}
    with pytest.raises(anthropic.BadRequestError, match="a user message holds text, image and tool_result blocks"):
        create(client, [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}])
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as error:
        wrong.messages.count_tokens(model="demo", messages=SORT)
    assert error.value.body["error"]["type"] == "authentication_error"
    # The OpenAI endpoints keep OpenAI's shape, and take the key in x-api-key as well.
    r = httpx.post(server.url + "/v1/chat/completions", headers={"x-api-key": KEY}, json={"messages": []})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200
    assert create(client, SORT).content[0].text == "1 2 3"


def test_a_server_tool_is_refused_by_name(server, client):
    """Anthropic's server tools (web search, code execution, ...) run on Anthropic's side: nothing here runs
    them, and the 400 says so, naming the tool, rather than pydantic's "Input should be 'custom'"."""
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    expected = ("tools.1: tool 'web_search' of type 'web_search_20250305' is not served: this server runs no "
                "Anthropic server tools nor other built-in tool types, only client tools (a name and an input_schema)")
    with pytest.raises(anthropic.BadRequestError) as error:
        create(client, WEATHER, tools=[TOOL, web_search])
    assert error.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": expected}}
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.count_tokens(model="demo", messages=WEATHER, tools=[TOOL, web_search])
    assert error.value.body["error"]["message"] == expected
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_500_is_in_anthropics_shape_too(tiny, monkeypatch):
    """In-process, as no request makes the real server fail: Starlette's error layer, outside every
    added middleware, sends a bug's 500; on /v1/messages it is Anthropic's `api_error`, elsewhere OpenAI's."""
    def broken(*args, **kwargs):
        raise TypeError("conversion broke")

    monkeypatch.setattr(serving, "chat_request", broken)
    app = build_app(AsyncEngine(LLMEngine(EngineConfig(tiny, max_model_len=64))), ServerConfig(["tiny"]))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=30) as http:
                r = await http.post("/v1/messages", json={"max_tokens": 4, "messages": SORT})
                assert r.status_code == 500
                assert r.json() == {"type": "error", "error": {"type": "api_error", "message": "internal server error: TypeError"}}
                r = await http.post("/v1/chat/completions", json={"messages": "not a list"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "messages"

    asyncio.run(main())


def test_conversation_as_chat_messages():
    """The translation alone: system blocks, an assistant turn's thinking, text and calls, a user
    turn's tool results (their images after them) and its text and images."""
    req = a.MessagesRequest.model_validate({
        "max_tokens": 8, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "18C"}, {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]},
                {"type": "text", "text": "And this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
        ]})
    assert chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    ]
