"""A chat choice's output split into thinking, text and tool calls, with tool_choice enforced.

One ChatOutput per choice is fed the choice's text as it arrives (all of it at once for a whole
response) and says what each piece adds: reasoning, content, and calls complete in it. With
`tool_choice` "required" or a named function, the output must consist of calls to the allowed
tools (thinking before them is fine): text is held back and never sent, and an output that breaks
the rule raises ToolChoiceNotFollowed instead of being returned as if it were an answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.reasoning import Gemma4ReasoningParser
from blockdiff.entrypoints.openai.tool_parsers import Gemma4ToolParser, ToolCall


class ToolChoiceNotFollowed(APIError):
    def __init__(self, message: str):
        super().__init__(422, message, param="tool_choice", code="tool_choice_not_followed")


@dataclass(frozen=True)
class OutputRules:
    """How one request's output is parsed."""

    reasoning: type[Gemma4ReasoningParser] | None = None
    tools: type[Gemma4ToolParser] | None = None  # None: calls are not parsed (no tools, or tool_choice "none")
    allowed: frozenset[str] | None = None  # with a forced tool_choice, the names calls may use
    parallel: bool = True  # several calls per output; else only the first is kept
    special: re.Pattern | None = None  # special tokens to drop from the text the parsers leave (skip_special_tokens)

    @property
    def parses(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def forced(self) -> bool:
        return self.allowed is not None


@dataclass
class OutputPiece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChatOutput:
    def __init__(self, rules: OutputRules):
        self.rules = rules
        self._reasoning = rules.reasoning() if rules.reasoning else None
        self._tools = rules.tools() if rules.tools else None
        self.calls: list[ToolCall] = []
        self._withheld = ""  # text of a forced-choice output, which must not have any

    def feed(self, text: str, final: bool) -> OutputPiece:
        out = OutputPiece(content=text)
        if self._reasoning is not None:
            split = self._reasoning.feed(text, final)
            out.reasoning, out.content = split.reasoning, split.content
        if self._tools is not None:
            split = self._tools.feed(out.content, final)
            out.content, out.calls = split.content, split.calls
            if not self.rules.parallel:
                out.calls = out.calls[: max(0, 1 - len(self.calls))]
            self.calls += out.calls
        if self.rules.forced:
            self._check(out, final)
            out.content = ""
        if self.rules.special is not None:
            out.reasoning, out.content = self.rules.special.sub("", out.reasoning), self.rules.special.sub("", out.content)
        return out

    def _check(self, out: OutputPiece, final: bool) -> None:
        allowed = self.rules.allowed
        for call in out.calls:
            if call.name not in allowed:
                raise ToolChoiceNotFollowed(f"tool_choice requires a call to {_names(allowed)}, but the model called "
                                            f"{call.name!r}")
        self._withheld += out.content
        if final and (not self.calls or self._withheld.strip()):
            text = self._withheld.strip()
            shown = text if len(text) <= 80 else text[:80] + "..."
            what = f"answered with text {shown!r}" if text else "made no tool call"
            raise ToolChoiceNotFollowed(f"tool_choice requires a call to {_names(allowed)}, but the model {what}")

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's finish reason, "tool_calls" once the output made calls (as vLLM reports it)."""
        return "tool_calls" if reason is not None and self.calls else reason


def _names(allowed: frozenset[str]) -> str:
    return " or ".join(repr(n) for n in sorted(allowed))

