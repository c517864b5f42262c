"""Reasoning parsers: the model's thinking split from its answer (`--reasoning-parser`).

Gemma 4 thinks in a channel, `<|channel>thought\\n...<channel|>`, before its answer (the chat
template asks for it with `<|think|>` when `enable_thinking` is set). The parser is a small state
machine fed the output's text delta by delta, so streaming and whole responses share one code path;
text that may be the start of a marker waits for the next delta.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockdiff.entrypoints.openai.stream_text import held_suffix

REASONING_PARSERS = ("gemma4",)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class Gemma4ReasoningParser:
    start, end = "<|channel>", "<channel|>"
    label = "thought\n"  # the channel's role label, not part of the thought

    def __init__(self):
        self._buffer = ""
        self._thinking = False
        self._at_label = False  # just after the start marker, where the label may still come

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return cls.start, cls.end

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        """The reasoning and content that `text` (the next piece of output) completes; with `final`,
        everything still held back."""
        out = ReasoningDelta()
        buf = self._buffer + text
        while buf:
            if self._at_label:
                if not final and self.label.startswith(buf) and buf != self.label:
                    break  # could still become the label
                buf = buf.removeprefix(self.label)
                self._at_label = False
                continue
            marker = self.end if self._thinking else self.start
            i = buf.find(marker)
            if i < 0:
                keep = 0 if final else held_suffix(buf, (marker,))
                self._emit(out, buf[: len(buf) - keep])
                buf = buf[len(buf) - keep :]
                break
            self._emit(out, buf[:i])
            buf = buf[i + len(marker) :]
            self._thinking = not self._thinking
            self._at_label = self._thinking
        self._buffer = buf
        return out

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self._thinking:
            out.reasoning += text
        else:
            out.content += text


def reasoning_parser(name: str) -> type[Gemma4ReasoningParser]:
    if name == "gemma4":
        return Gemma4ReasoningParser
    raise ValueError(f"unknown reasoning parser {name!r}; the parsers are {', '.join(REASONING_PARSERS)}")
