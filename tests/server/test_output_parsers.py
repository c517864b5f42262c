"""The Gemma 4 tool-call and reasoning parsers, and tool_choice enforcement, on text: whole, and cut
into deltas at every position (a canvas's text may end anywhere, even inside a marker)."""

from __future__ import annotations

import json

import pytest

from blockdiff.entrypoints.openai.chat_output import ChatOutput, OutputRules, ToolChoiceNotFollowed
from blockdiff.entrypoints.openai.reasoning import Gemma4ReasoningParser
from blockdiff.entrypoints.openai.tool_parsers import Gemma4ToolParser, ToolCallSyntaxError, parse_call

Q = '<|"|>'
CALLS = (f"Let me check. <|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>"
         f"<|tool_call>call:mod.find-all{{q:{Q}a, b: {{c}}{Q},opts:{{deep:true,limit:null,ratio:0.5,tags:[{Q}x{Q},2,[]]}},"
         f"{Q}odd key{Q}:-1}}<tool_call|> done")
THOUGHT = "<|channel>thought\nFirst, the digits.<channel|>1 2 3"


def feed_in_pieces(parser, text: str, cuts: list[int]):
    bounds = [0, *cuts, len(text)]
    pieces = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    return pieces + [parser.feed("", final=True)]


def test_parse_call_values():
    call = parse_call(CALLS.split("<|tool_call>")[2].split("<tool_call|>")[0])
    assert call.name == "mod.find-all"
    assert call.arguments == {"q": "a, b: {c}", "opts": {"deep": True, "limit": None, "ratio": 0.5, "tags": ["x", 2, []]},
                              "odd key": -1}
    assert json.loads(call.arguments_json) == call.arguments
    for bad in ["call:f{a:}", "call:f{a:<|\"|>x}", "call:f{a:1", "f{a:1}", "call:f{a:1 b:2}", "call:f{a:[1}"]:
        with pytest.raises(ToolCallSyntaxError):
            parse_call(bad)


@pytest.mark.parametrize("cuts", [[c] for c in range(1, len(CALLS))] + [list(range(1, len(CALLS)))],
                         ids=lambda cuts: "each-char" if len(cuts) > 1 else str(cuts[0]))
def test_tool_parser_any_cut(cuts):
    pieces = feed_in_pieces(Gemma4ToolParser(), CALLS, cuts)
    assert "".join(p.content for p in pieces) == "Let me check.  done"
    calls = [c for p in pieces for c in p.calls]
    assert [(c.name, c.arguments.get("q", c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("mod.find-all", "a, b: {c}")]
    assert len({c.id for c in calls}) == 2


def test_tool_parser_keeps_malformed_and_unfinished_calls_as_text():
    parser = Gemma4ToolParser()
    text = "a<|tool_call>call:f{x:<tool_call|>b<|tool_call>call:g{y:1"
    pieces = feed_in_pieces(parser, text, [5, 30])
    assert "".join(p.content for p in pieces) == text and not any(p.calls for p in pieces)
    assert len(parser.malformed) == 2


@pytest.mark.parametrize("cut", range(len(THOUGHT) + 1))
def test_reasoning_parser_any_cut(cut):
    pieces = feed_in_pieces(Gemma4ReasoningParser(), THOUGHT, [cut] if 0 < cut < len(THOUGHT) else [])
    assert "".join(p.reasoning for p in pieces) == "First, the digits."
    assert "".join(p.content for p in pieces) == "1 2 3"


def test_reasoning_parser_without_thought_or_unfinished():
    pieces = feed_in_pieces(Gemma4ReasoningParser(), "1 2 3 <not a marker", [3])
    assert "".join(p.content for p in pieces) == "1 2 3 <not a marker" and not any(p.reasoning for p in pieces)
    pieces = feed_in_pieces(Gemma4ReasoningParser(), "<|channel>thought\nstill thinking", [12])
    assert "".join(p.reasoning for p in pieces) == "still thinking" and not any(p.content for p in pieces)


def rules(**kw) -> OutputRules:
    return OutputRules(reasoning=Gemma4ReasoningParser, tools=Gemma4ToolParser, **kw)


def test_chat_output_thinking_then_call():
    out = ChatOutput(rules(allowed=frozenset({"get_weather"})))
    text = f"<|channel>thought\nI call it.<channel|><|tool_call>call:get_weather{{city:{Q}Rome{Q}}}<tool_call|>"
    piece = out.feed(text, final=True)
    assert piece.reasoning == "I call it." and piece.content == ""
    assert [c.arguments for c in piece.calls] == [{"city": "Rome"}]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason(None) is None


@pytest.mark.parametrize("text, why", [
    ("1 2 3", "answered with text '1 2 3'"),
    ("", "made no tool call"),
    (f"<|tool_call>call:other{{}}<tool_call|>", "called 'other'"),
    (f"<|tool_call>call:get_weather{{city:{Q}Rome{Q}}}<tool_call|> and text", "answered with text 'and text'"),
    ("<|tool_call>call:get_weather{city:", "answered with text"),  # unfinished: not a call
])
def test_forced_tool_choice_refuses(text, why):
    out = ChatOutput(rules(allowed=frozenset({"get_weather"})))
    with pytest.raises(ToolChoiceNotFollowed, match=why) as e:
        out.feed(text, final=True)
    assert e.value.status == 422 and e.value.code == "tool_choice_not_followed"


def test_parallel_tool_calls_false_keeps_the_first():
    out = ChatOutput(rules(parallel=False))
    pieces = [out.feed(CALLS[:60], False), out.feed(CALLS[60:], True)]
    assert [c.name for p in pieces for c in p.calls] == ["get_weather"]
