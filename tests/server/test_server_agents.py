"""Tool calls and thinking through the real server and the official `openai` client, from the bundled
demo model, which was taught the weather tool and thinking (blockdiff/demo/tasks.py, docs/demo.md):
the Gemma 4 parsers read its calls and thoughts; asked a question that needs no tool, it answers in
text, and a forced tool_choice constrains its output to a call that matches the tool's schema.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_process import ServerProcess, serve

from blockdiff.demo.tasks import WEATHER_TOOL

GREEDY = dict(temperature=0, seed=0, max_tokens=48)
WEATHER = [{"role": "user", "content": "weather in Paris"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _client(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)


server = serve(None, "--max-model-len", "512")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _client(server)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="demo", messages=messages, **{**GREEDY, **kw})


def stream(client, messages, **kw) -> tuple[list, list]:
    """-> (the choice's deltas, its finish reasons), from every chunk."""
    chunks = list(chat(client, messages, stream=True, **kw))
    return [c.choices[0].delta for c in chunks if c.choices], [c.choices[0].finish_reason for c in chunks if c.choices]


def assert_weather_call(call, city: str) -> None:
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": city}


@pytest.mark.parametrize("tool_choice", [None, "auto", "required", NAMED], ids=["default", "auto", "required", "named"])
def test_tool_call(client, tool_choice):
    kw = {} if tool_choice is None else {"tool_choice": tool_choice}
    r = chat(client, WEATHER, tools=[WEATHER_TOOL], **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_weather_call(choice.message.tool_calls[0], "Paris")


def test_tool_call_streaming(client):
    deltas, reasons = stream(client, [{"role": "user", "content": "weather in Lima"}], tools=[WEATHER_TOOL])
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0
    assert_weather_call(calls[0], "Lima")
    assert "".join(d.content or "" for d in deltas) == ""  # no marker leaks into the text
    assert reasons[-1] == "tool_calls" and reasons[:-1] == [None] * (len(reasons) - 1)


def test_tool_choice_none_reads_no_calls(client):
    r = chat(client, WEATHER, tools=[WEATHER_TOOL], tool_choice="none")
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason == "stop"
    assert "call:get_weather{" in r.choices[0].message.content  # the call, left as text


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_tool_result_is_answered(client, streaming):
    first = chat(client, WEATHER, tools=[WEATHER_TOOL]).choices[0].message
    messages = [*WEATHER, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18C sunny"}]
    if streaming:
        deltas, reasons = stream(client, messages, tools=[WEATHER_TOOL])
        text, calls, reason = "".join(d.content or "" for d in deltas), [c for d in deltas for c in d.tool_calls or []], reasons[-1]
    else:
        choice = chat(client, messages, tools=[WEATHER_TOOL]).choices[0]
        text, calls, reason = choice.message.content, choice.message.tool_calls, choice.finish_reason
    assert text == "Paris: 18C sunny" and not calls and reason == "stop"


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_choice_calls_the_tool_even_for_a_text_question(client, tool_choice):
    """A question that needs no tool is answered in text; a forced tool_choice constrains the output
    to a call whose arguments match the tool's parameter schema (blockdiff/structured), so the call
    comes, streamed or not, with no text beside it."""
    question = [{"role": "user", "content": "sort: 3 1 2"}]
    free = chat(client, question, tools=[WEATHER_TOOL]).choices[0]
    assert free.message.tool_calls == [] and free.message.content.strip()
    choice = chat(client, question, tools=[WEATHER_TOOL], tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    deltas, reasons = stream(client, question, tools=[WEATHER_TOOL], tool_choice=tool_choice)
    assert [c.function.arguments for d in deltas for c in d.tool_calls or []] == [call.function.arguments]
    assert not "".join(d.content or "" for d in deltas) and reasons[-1] == "tool_calls"


def test_named_get_weather_always_parses_against_its_schema(client):
    """Sampled (the default temperatures), across seeds and questions, the named call parses and
    its arguments validate against the tool's parameter schema."""
    questions = ["weather in Paris", "weather in Oslo", "sort: 4 2 9", "reverse: stone", "hello there"]
    for seed, question in enumerate(questions):
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": question}], seed=seed,
                                           max_tokens=48, tools=[WEATHER_TOOL], tool_choice=NAMED, n=2)
        for choice in r.choices:
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])


def test_named_choice_of_a_tool_the_model_never_learned(client):
    """The model only knows get_weather; named get_time is asked for, with a schema of two
    arguments: the constraint writes a get_time call whose arguments match it."""
    time_tool = {"type": "function", "function": {"name": "get_time", "description": "Time of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "hours": {"enum": [12, 24]}}, "required": ["city"]}}}
    tool_choice = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, WEATHER, tools=[WEATHER_TOOL, time_tool], tool_choice=tool_choice)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), time_tool["function"]["parameters"])


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_thinking_on_and_off(client, streaming):
    question = [{"role": "user", "content": "reverse: block"}]
    for thinking, reasoning in ((True, "I reverse the word."), (False, None)):
        kw = dict(extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        if streaming:
            deltas, _ = stream(client, question, **kw)
            text = "".join(d.content or "" for d in deltas)
            thought = "".join(d.reasoning_content or "" for d in deltas) or None
            assert thought == ("".join(d.reasoning or "" for d in deltas) or None)
        else:
            message = chat(client, question, **kw).choices[0].message
            text, thought = message.content, message.reasoning_content
            assert message.reasoning == thought
        assert (text, thought) == ("kcolb", reasoning)


def test_bad_tool_requests_are_400(client):
    cases = [
        (dict(extra_body={"chat_template_kwargs": {"enable_thinking": True, "thinking_budget": 5}}), "does not read thinking_budget"),
        (dict(extra_body={"chat_template_kwargs": {"tools": []}}), "may not set tools"),
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope', which is not among"),
    ]
    for kw, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            chat(client, WEATHER, **kw)
    bad_args = [*WEATHER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                "function": {"name": "get_weather", "arguments": "{city"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"tool_calls\[0\].function.arguments is not JSON"):
        chat(client, bad_args, tools=[WEATHER_TOOL])
