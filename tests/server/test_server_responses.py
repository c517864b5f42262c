"""`/v1/responses` (OpenAI's Responses API) through the real server, judged by the official `openai`
client (its typed events and its `responses.stream` accumulator, which checks the event sequence)
and by openai-agents' default model, on the bundled demo model: it was taught to call `get_weather`
for "weather in CITY", to answer from the tool's result, and to think when the template asks it
(blockdiff/demo/tasks.py, docs/demo.md).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import openai
import pytest
from server_process import ServerProcess, serve

from blockdiff.demo.tasks import WEATHER_TOOL
from blockdiff.entrypoints.openai import responses_protocol as r
from blockdiff.entrypoints.openai.responses import ResponseStore, chat_messages
from pydantic import TypeAdapter

GREEDY = dict(temperature=0, extra_body={"seed": 0})
TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's function tools are flat
THOUGHT = "<|channel>thought\nI reverse the word.<channel|>"


server = serve(None, "--max-model-len", "512")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def create(client, input, **kw):
    return client.responses.create(model="demo", input=input, **{**GREEDY, **kw})


def events(client, input, **kw) -> list:
    return list(create(client, input, stream=True, **kw))


def tokens_of(server, **body) -> int:
    reply = httpx.post(server.url + "/tokenize", json={"model": "demo", **body}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def test_text(client, server):
    response = create(client, "sort: 3 1 2")
    assert response.status == "completed" and response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == "1 2 3"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    u = response.usage
    # The input is rendered by the chat template exactly as the chat endpoint renders these messages.
    assert u.input_tokens == tokens_of(server, messages=[{"role": "user", "content": "sort: 3 1 2"}])
    assert u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert response.temperature == 0 and response.store is True and response.tool_choice == "auto"
    # The diffusion extensions work as on the chat endpoint, and usage reports the diffusion work.
    one_step = create(client, "sort: 3 1 2", extra_body={"seed": 0, "max_denoising_steps": 1}).usage.diffusion
    assert one_step["canvases"] >= 1 and one_step["denoising_steps"] == one_step["canvases"]
    assert u.diffusion["denoising_steps"] > u.diffusion["canvases"]


def test_instructions_and_input_items_are_the_chat_templates_messages(client, server):
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "sort: 3 1 2"}]}]
    response = create(client, items, instructions="You sort digits.", max_output_tokens=8)
    messages = [{"role": "system", "content": "You sort digits."}, {"role": "user", "content": "sort: 3 1 2"}]
    assert response.usage.input_tokens == tokens_of(server, messages=messages)
    assert response.instructions == "You sort digits." and response.max_output_tokens == 8


def test_streamed_text(client):
    stream = events(client, "reverse: block", stream_options={"include_obfuscation": False})
    kinds = [e.type for e in stream]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in stream] == list(range(len(stream)))
    assert stream[0].response.status == "in_progress" and stream[0].response.output == []
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    final = stream[-1].response
    assert text == "kcolb" == final.output_text and final.status == "completed" and final.usage.output_tokens > 0
    assert stream[2].item.id == final.output[0].id == stream[-2].item.id
    # The client's own accumulator rebuilds the same response from the events.
    with client.responses.stream(model="demo", input="reverse: block", **GREEDY) as s:
        assert s.get_final_response().output_text == "kcolb"


def assert_weather_call(item, city: str) -> None:
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert json.loads(item.arguments) == {"city": city}


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_tool_call_round_trip(client, streaming):
    question = [{"role": "user", "content": "weather in Paris"}]
    if streaming:
        stream = events(client, question, tools=[TOOL])
        assert [e.type for e in stream] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.function_call_arguments.delta",
                                            "response.function_call_arguments.done", "response.output_item.done",
                                            "response.completed"]
        assert stream[2].item.arguments == "" and stream[2].item.status == "in_progress"
        assert stream[3].delta == stream[4].arguments == stream[5].item.arguments
        output = stream[-1].response.output
    else:
        output = create(client, question, tools=[TOOL]).output
    [call] = output  # no message beside the call
    assert_weather_call(call, "Paris")
    # The call and its output go back as input items, as a client replays them.
    items = [*question, call.model_dump(exclude_unset=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "18C sunny"}]
    answer = create(client, items, tools=[TOOL])
    assert answer.output_text == "Paris: 18C sunny" and [o.type for o in answer.output] == ["message"]


def test_the_stream_helper_accumulates_a_call(client):
    with client.responses.stream(model="demo", input="weather in Lima", tools=[TOOL], **GREEDY) as s:
        [call] = s.get_final_response().output
    assert_weather_call(call, "Lima")


def test_previous_response_id_continues_a_stored_response(client):
    first = create(client, "weather in Paris", tools=[TOOL])
    [call] = first.output
    answer = create(client, [{"type": "function_call_output", "call_id": call.call_id, "output": "18C sunny"}],
                    previous_response_id=first.id, tools=[TOOL])
    assert answer.output_text == "Paris: 18C sunny" and answer.previous_response_id == first.id
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert e.value.body["code"] == "response_not_found"
    unstored = create(client, "weather in Paris", tools=[TOOL], store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as e:
        create(client, "more", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_reasoning_turns_thinking_on_and_off(client, server, streaming):
    for effort, thought in (("medium", "I reverse the word."), ("none", None)):
        if streaming:
            stream = events(client, "reverse: block", reasoning={"effort": effort})
            response = stream[-1].response
            deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
            assert deltas == (thought or "")
            assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == "kcolb"
        else:
            response = create(client, "reverse: block", reasoning={"effort": effort})
        assert response.output_text == "kcolb" and response.output[-1].type == "message"
        reasoning = [o for o in response.output if o.type == "reasoning"]
        assert [part.text for o in reasoning for part in o.content] == ([thought] if thought else [])
        thought_tokens = tokens_of(server, prompt=THOUGHT, add_special_tokens=False) if thought else 0
        assert response.usage.output_tokens_details.reasoning_tokens == thought_tokens
        assert response.reasoning.effort == effort


def test_forced_tool_choice(client):
    named = create(client, "weather in Oslo", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert_weather_call(named.output[0], "Oslo")
    # A question that needs no tool is answered in text; a forced choice constrains the output to a
    # call whose arguments match the tool's parameters (as on /v1/chat/completions), streamed or not.
    assert create(client, "sort: 3 1 2", tools=[TOOL]).output_text.strip()
    forced = create(client, "sort: 3 1 2", tools=[TOOL], tool_choice="required")
    [call] = [item for item in forced.output if item.type == "function_call"]
    assert call.name == "get_weather" and not forced.output_text
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    stream = events(client, "sort: 3 1 2", tools=[TOOL], tool_choice="required")
    assert stream[-1].type == "response.completed"
    assert not any(e.type == "response.output_text.delta" for e in stream)
    done = [e.item for e in stream if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [item.arguments for item in done] == [call.arguments]


def test_text_format_is_a_structured_output(client):
    """text.format, the Responses API's response_format: the reply parses into the schema, whole and streamed."""
    schema = {"type": "object", "properties": {"digits": {"type": "array", "items": {"type": "integer"}}},
              "required": ["digits"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "sorted", "schema": schema, "strict": True}}
    response = create(client, "sort: 3 1 2", text=fmt)
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    streamed = "".join(e.delta for e in events(client, "sort: 3 1 2", text=fmt) if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(streamed), schema)
    assert isinstance(json.loads(create(client, "sort: 3 1 2", text={"format": {"type": "json_object"}}).output_text), dict)


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = create(client, "reverse: abcdefghijkl", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"
    stream = events(client, "reverse: abcdefghijkl", max_output_tokens=3)
    assert stream[-1].type == "response.incomplete" and stream[-1].response.output_text == response.output_text


CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{city"}
BAD = [
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "integer", "minimum": 3}}}),
     "text.format", "the keyword 'minimum' is not supported"),
    (dict(tools=[{"type": "web_search"}]), "tools", "'web_search' is one of OpenAI's hosted tools"),
    (dict(tools=[{"type": "function", "name": "bad name"}]), "tools", "tools.0.function.name"),
    (dict(background=True), "background", "background responses are not supported"),
    (dict(input=[{"type": "computer_call_output", "call_id": "c"}]), "input", r"input.0: an input item's type must be"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input",
     "input.0.message.content.0: Input tag 'input_file'"),
    (dict(input=[{"role": "user", "content": "weather in Paris"}, CALL]), "input", r"input\[1\].arguments is not JSON"),
    (dict(input=[{"role": "user", "content": "weather in Paris"}, {**CALL, "arguments": '{"t": NaN}'}]), "input",
     "holds NaN, which is not a JSON number"),
    (dict(input=[]), "input", "input is empty"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]), "input", "Files API"),
    (dict(extra_body={"conversation": "conv_1"}), "conversation", "Conversations API"),
    (dict(extra_body={"prompt": {"id": "pmpt_1"}}), "prompt", "stored prompt templates"),
    (dict(stream_options={"include_obfuscation": False}), "stream_options", "needs stream: true"),
    (dict(truncation="auto"), "truncation", "truncation 'auto' is not supported"),
    (dict(include=["message.output_text.logprobs"]), "include", "logprobs are not served"),
    (dict(include=["file_search_call.results"]), "include", "not supported"),
    (dict(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
    (dict(max_output_tokens=0), "max_output_tokens", "max_output_tokens"),
    (dict(max_output_tokens=600), "max_output_tokens", "max_model_len"),
    (dict(reasoning={"effort": "huge"}), "reasoning", "effort"),
    # The sampler's fields are the chat endpoint's, checked as there.
    (dict(extra_body={"max_denoising_steps": 0}), "max_denoising_steps", "max_denoising_steps"),
    (dict(extra_body={"entropy_bound": -1.0}), "entropy_bound", "entropy_bound"),
    (dict(extra_body={"stream_drafts": True}), "stream_drafts", "Extra inputs are not permitted"),
]


@pytest.mark.parametrize("kw, param, message", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_are_4xx_with_an_openai_error_body(client, kw, param, message):
    kw = {"input": "sort: 3 1 2", **kw}
    with pytest.raises(openai.BadRequestError, match=message) as e:
        client.responses.create(model="demo", **kw)
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param


def test_unknown_ids_are_404_and_the_server_stays_up(client):
    with pytest.raises(openai.NotFoundError) as e:
        create(client, "sort: 1 2", previous_response_id="resp_nope")
    assert e.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-4.1", input="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_nope")
    assert create(client, "upper: block").output_text == "BLOCK"


def test_items_become_chat_messages():
    """Consecutive output items of one turn make one assistant message (thinking, text, calls);
    outputs of calls are tool messages; instructions come first as the system message."""
    items = TypeAdapter(list[r.InputItem]).validate_python([
        {"role": "user", "content": "weather in Paris"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "I look it up."}]},
        {"type": "message", "role": "assistant", "id": "m", "status": "completed", "phase": "commentary",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "18C sunny"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."},
                                          {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
    ])
    assert chat_messages(items, "You answer weather questions.") == [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "I look it up.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C sunny"},
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
    ]


def test_the_store_drops_the_oldest_responses_past_its_budget(client):
    responses = [r.ResponseObject.model_validate(create(client, f"upper: {word}", store=False).model_dump())
                 for word in ("abc", "def", "ghi")]
    item = TypeAdapter(r.InputItem).validate_python({"role": "user", "content": "upper: abc"})
    # Room for two of the three: each takes its response's JSON and its turn's.
    store = ResponseStore(max_bytes=2 * max(len(x.model_dump_json()) + len(item.model_dump_json()) for x in responses))
    for response in responses:
        assert store.put(response, [item], None, "a")
    assert [store.get(x.id, "a") is not None for x in responses] == [False, True, True]
    assert store.get(responses[2].id, "b") is None and not store.delete(responses[2].id, "b")  # only its client's
    assert store.delete(responses[1].id, "a") and not store.delete(responses[1].id, "a") and store.get(responses[1].id, "a") is None
    assert store.conversation(responses[2].id, "a") == [item]


def test_a_chain_counts_each_turn_once_and_a_broken_chain_is_gone(client):
    """Each response keeps its own turn and the id of the one it continued: a conversation is read
    back along the chain, so a long chain does not hold a copy of everything before each turn."""
    turns = [TypeAdapter(r.InputItem).validate_python({"role": "user", "content": f"turn {i} " + "x" * 1000})
             for i in range(6)]
    base = r.ResponseObject.model_validate(create(client, "upper: abc", store=False).model_dump())
    responses = [base.model_copy(update={"id": f"resp_{i}"}) for i in range(6)]
    one = len(responses[0].model_dump_json()) + len(turns[0].model_dump_json())
    store = ResponseStore(max_bytes=4 * one + 50)
    for i, (response, turn) in enumerate(zip(responses, turns)):
        store.put(response, [turn], None if i == 0 else f"resp_{i - 1}", "a")
    assert store._bytes <= store.max_bytes  # four turns fit, the oldest two are gone
    assert store.conversation("resp_5", "a") is None  # its chain starts at a dropped response
    assert [store.get(x.id, "a") is not None for x in responses] == [False, False, True, True, True, True]
    assert not store.put(base.model_copy(update={"id": "big"}), turns * 5, None, "a")  # larger than the store: not kept


def test_stored_responses_expire(client):
    store = ResponseStore(2**20, ttl=0.2)
    response = r.ResponseObject.model_validate(create(client, "upper: abc", store=False).model_dump())
    store.put(response, [], None, "a")
    response_id = response.id
    assert store.get(response_id, "a") is not None
    time.sleep(0.3)
    assert store.get(response_id, "a") is None and store.conversation(response_id, "a") is None


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_default_model_runs_a_tool_round_trip(server, streamed):
    """openai-agents' default model is the Responses API one (OpenAIResponsesModel): an Agent with a
    function tool, given the demo's question, calls the tool and answers from its result."""
    from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_client,
                        set_tracing_disabled)

    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather of a city"""
        asked.append(city)
        return "18C sunny"

    async def run():
        set_tracing_disabled(True)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as api:
            set_default_openai_client(api, use_for_tracing=False)
            agent = Agent(name="weather", model="demo", tools=[get_weather],
                          model_settings=ModelSettings(temperature=0, extra_body={"seed": 0}))
            if not streamed:
                return await Runner.run(agent, "weather in Paris")
            result = Runner.run_streamed(agent, "weather in Paris")
            async for _ in result.stream_events():
                pass
            return result

    result = asyncio.run(run())
    assert asked == ["Paris"]
    assert result.final_output == "Paris: 18C sunny"
    # Two model calls, both answered by /v1/responses (chat completions would leave no response id).
    assert [resp.response_id[:5] for resp in result.raw_responses] == ["resp_", "resp_"]
    assert "POST /v1/chat/completions" not in server.log()


def test_another_client_can_neither_read_continue_nor_delete_a_stored_response(server):
    """A stored response is its client's: another address gets a 404 for it,
    as for one that does not exist, and it stays stored for its own client."""
    def call(source: str, method: str, path: str, **kw) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as c:
            return c.request(method, server.url + path, **kw)

    made = call("127.0.0.1", "POST", "/v1/responses", json={"model": "demo", "input": "upper: secret"}).json()
    for method, path, kw in (("GET", f"/v1/responses/{made['id']}", {}), ("DELETE", f"/v1/responses/{made['id']}", {}),
                             ("POST", "/v1/responses", {"json": {"model": "demo", "input": "again",
                                                                 "previous_response_id": made["id"]}})):
        r = call("127.0.0.2", method, path, **kw)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    assert call("127.0.0.1", "GET", f"/v1/responses/{made['id']}").json()["output"] == made["output"]


@pytest.mark.slow  # a server of its own and 675 MiB of uploads
def test_a_chain_of_large_turns_stays_within_the_store(tmp_path):
    """The issue's attack at its size: 45 chained responses whose input carries a 15 MiB reasoning
    summary (stored, never tokenized), against a 64 MiB store. The chain once kept every turn in its
    newest entry (675 MiB); now each turn is stored once and the oldest go, so the server's memory
    stays flat: within the store's cap of where it stood after the first turns."""
    import psutil

    proc = ServerProcess(None, "--max-model-len", "256", "--responses-store-size", "64MiB",
                         log_path=str(tmp_path / "server.log"))
    try:
        rss = psutil.Process(proc.proc.pid).memory_info
        summary = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "z" * (15 * 2**20)}]}
        previous, before = None, None
        for i in range(45):
            body = {"model": "demo", "input": [summary, {"role": "user", "content": "upper: abc"}], "max_output_tokens": 8}
            r = httpx.post(proc.url + "/v1/responses", json={**body, "previous_response_id": previous}, timeout=120)
            if r.status_code == 404:  # the chain's start was dropped to make room: start a new one
                r = httpx.post(proc.url + "/v1/responses", json=body, timeout=120)
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
            if i == 5:
                before = rss().rss
        assert rss().rss - before < 64 * 2**20, (rss().rss - before) / 2**20
    finally:
        proc.close()
