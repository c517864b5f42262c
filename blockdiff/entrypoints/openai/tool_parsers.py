"""Tool-call parsers: calls in the model's output become OpenAI tool calls (`--tool-call-parser`).

Gemma 4 writes a call as `<|tool_call>call:NAME{key:value,...}<tool_call|>`, several calls one after
another. Keys are bare, strings are quoted by the `<|"|>` token, and values nest as `{...}` objects
and `[...]` lists; numbers, true, false and null are bare. The parser is a state machine fed the
output's text delta by delta (streaming and whole responses share it): text outside calls is
content, a call is reported once its end marker has arrived, and text that may be the start of a
marker waits for the next delta.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from blockdiff.entrypoints.openai.stream_text import held_suffix

TOOL_CALL_PARSERS = ("gemma4",)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallSyntaxError(ValueError):
    pass


class Gemma4ToolParser:
    start, end, quote = "<|tool_call>", "<tool_call|>", '<|"|>'
    _call = re.compile(r"call:([\w\-.]+)\{(.*)\}\Z", re.DOTALL)

    def __init__(self):
        self._buffer = ""
        self._in_call = False
        self.malformed: list[str] = []  # calls that did not parse, kept as content

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return cls.start, cls.end, cls.quote

    def feed(self, text: str, final: bool = False) -> ToolDelta:
        """The content and complete calls that `text` (the next piece of content) completes; with
        `final`, everything still held back (an unfinished call is returned as content)."""
        out = ToolDelta()
        buf = self._buffer + text
        while buf:
            if self._in_call:
                i = buf.find(self.end)
                if i < 0:
                    break
                body, buf = buf[:i], buf[i + len(self.end) :]
                self._in_call = False
                try:
                    out.calls.append(parse_call(body))
                except ToolCallSyntaxError:
                    self.malformed.append(body)
                    out.content += self.start + body + self.end
                continue
            i = buf.find(self.start)
            if i < 0:
                keep = 0 if final else held_suffix(buf, (self.start,))
                out.content += buf[: len(buf) - keep]
                buf = buf[len(buf) - keep :]
                break
            out.content += buf[:i]
            buf = buf[i + len(self.start) :]
            self._in_call = True
        if final and self._in_call:
            self.malformed.append(buf)
            out.content += self.start + buf
            buf, self._in_call = "", False
        self._buffer = buf
        return out


def parse_call(body: str) -> ToolCall:
    """`call:NAME{...}` (the text between the markers) -> ToolCall."""
    m = Gemma4ToolParser._call.match(body.strip())
    if m is None:
        raise ToolCallSyntaxError(f"not a call: {body!r}")
    args, _ = _Reader(m.group(2)).object_body(0, closing=None)
    return ToolCall(m.group(1), args)


class _Reader:
    """Recursive descent over Gemma 4's argument syntax."""

    q = '<|"|>'

    def __init__(self, text: str):
        self.text = text

    def object_body(self, i: int, closing: str | None) -> tuple[dict, int]:
        out: dict = {}
        t = self.text
        while True:
            i = self._space(i)
            if i == len(t) or (closing and t.startswith(closing, i)):
                if closing is None and i != len(t):
                    raise ToolCallSyntaxError(f"unexpected {t[i]!r}")
                if closing is not None and i == len(t):
                    raise ToolCallSyntaxError("unclosed object")
                return out, i + (len(closing) if closing else 0)
            if t.startswith(self.q, i):
                key, i = self._string(i)
            else:
                j = t.find(":", i)
                if j < 0:
                    raise ToolCallSyntaxError(f"a key without a value: {t[i:]!r}")
                key, i = t[i:j].strip(), j
            if not key or not t.startswith(":", i):
                raise ToolCallSyntaxError(f"bad key at {t[i:]!r}")
            out[key], i = self.value(i + 1)
            i = self._space(i)
            if t.startswith(",", i):
                i += 1
            elif not (i == len(t) or (closing and t.startswith(closing, i))):
                raise ToolCallSyntaxError(f"expected ',' at {t[i:]!r}")

    def value(self, i: int):
        t = self.text
        i = self._space(i)
        if t.startswith(self.q, i):
            return self._string(i)
        if t.startswith("{", i):
            return self.object_body(i + 1, "}")
        if t.startswith("[", i):
            items, i = [], i + 1
            while True:
                i = self._space(i)
                if t.startswith("]", i):
                    return items, i + 1
                if i == len(t):
                    raise ToolCallSyntaxError("unclosed list")
                item, i = self.value(i)
                items.append(item)
                i = self._space(i)
                if t.startswith(",", i):
                    i += 1
        j = i
        while j < len(t) and t[j] not in ",}]":
            j += 1
        return _scalar(t[i:j].strip()), j

    def _string(self, i: int) -> tuple[str, int]:
        start = i + len(self.q)
        end = self.text.find(self.q, start)
        if end < 0:
            raise ToolCallSyntaxError("unclosed string")
        return self.text[start:end], end + len(self.q)

    def _space(self, i: int) -> int:
        while i < len(self.text) and self.text[i].isspace():
            i += 1
        return i


def _scalar(word: str):
    if word in ("true", "false"):
        return word == "true"
    if word == "null":
        return None
    try:
        return int(word)
    except ValueError:
        pass
    try:
        return float(word)
    except ValueError:
        raise ToolCallSyntaxError(f"not a value: {word!r}") from None


def tool_call_parser(name: str) -> type[Gemma4ToolParser]:
    if name == "gemma4":
        return Gemma4ToolParser
    raise ValueError(f"unknown tool-call parser {name!r}; the parsers are {', '.join(TOOL_CALL_PARSERS)}")
