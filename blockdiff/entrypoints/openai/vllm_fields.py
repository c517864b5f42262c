"""Request fields a vLLM client sends beyond OpenAI's core, with their vLLM meaning: `echo` (the
prompt before the completion, and with `logprobs` the prompt's scores: docs/architecture.md,
"Scoring"), `reasoning_effort` (thinking on or off through the chat template's switch),
`stream_options.continuous_usage_stats`, `min_tokens`, `skip_special_tokens`, `metadata`."""

from __future__ import annotations

import pydantic_core

from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.outputs import TokenLogprob

# reasoning_effort values that turn thinking off; the others turn it on.
_NO_THINKING = ("none", "minimal")
# Template variables that switch thinking, in the order they are tried: one that takes the effort
# itself (gpt-oss' templates), then Gemma's and Qwen's on/off switch.
_EFFORT_VARIABLE = "reasoning_effort"
_THINKING_SWITCH = "enable_thinking"


def reasoning_kwargs(effort: str | None, template_variables: frozenset[str], kwargs: dict) -> dict:
    """chat_template_kwargs with `reasoning_effort` applied through the variable the template reads:
    the effort itself where it reads `reasoning_effort`, else `enable_thinking` (off for "none" and
    "minimal", on otherwise). A 400 where the template has neither, or the two fields disagree."""
    if effort is None:
        return kwargs
    if _EFFORT_VARIABLE in template_variables:
        return {_EFFORT_VARIABLE: effort, **kwargs}
    if _THINKING_SWITCH not in template_variables:
        raise APIError(400, "reasoning_effort: this model's chat template has no thinking switch (it reads neither "
                            f"{_EFFORT_VARIABLE} nor {_THINKING_SWITCH})", param="reasoning_effort")
    thinking = effort not in _NO_THINKING
    if kwargs.get(_THINKING_SWITCH, thinking) != thinking:
        raise APIError(400, f"reasoning_effort {effort!r} turns thinking {'on' if thinking else 'off'}, but "
                            f"chat_template_kwargs sets {_THINKING_SWITCH}={kwargs[_THINKING_SWITCH]}",
                       param="reasoning_effort")
    return {**kwargs, _THINKING_SWITCH: thinking}


def echo_logprobs(ids: list[int], scores: list[TokenLogprob] | None, token_text, top: bool) -> p.CompletionLogprobs:
    """The prompt's part of an echoed choice's logprobs: every prompt token, its score (None for the
    first, which nothing scores) and, with `top`, its alternatives; text offsets from 0."""
    scores = scores or []
    tokens = [token_text(t) for t in ids]
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return p.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None, *(s.logprob for s in scores)],
        top_logprobs=[None, *({token_text(t): v for t, v in {s.token_id: s.logprob, **s.top}.items()} for s in scores)]
        if top else None,
        text_offset=offsets,
    )


def joined(a: p.CompletionLogprobs, b: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """a then b, not validated again: both were (a prompt's part, shared by its choices, is long)."""
    top = None if a.top_logprobs is None else a.top_logprobs + (b.top_logprobs or [])
    return p.CompletionLogprobs.model_construct(tokens=a.tokens + b.tokens,
                                                token_logprobs=a.token_logprobs + b.token_logprobs,
                                                top_logprobs=top, text_offset=a.text_offset + b.text_offset)


def written(logprobs: p.CompletionLogprobs) -> dict[str, str]:
    """Each list of `logprobs` (those it has, not empty) as JSON, its items without the brackets:
    the prompt's part of every choice's logprobs, written once for `spliced`."""
    lists = {name: getattr(logprobs, name) for name in p.CompletionLogprobs.model_fields}
    return {name: pydantic_core.to_json(items).decode()[1:-1] for name, items in lists.items() if items}


def spliced(choice: str, head: dict[str, str]) -> str:
    """`joined` on a choice's JSON: the items of each of its logprobs lists that `head` has (written)
    put before its own. The lists' names are found as keys: in a string, a quote is escaped."""
    parts, at = [], 0
    for name, items in head.items():
        cut = choice.index(f'"{name}":[', at) + len(name) + 4
        parts += [choice[at:cut], items, "" if choice[cut] == "]" else ","]
        at = cut
    return "".join(parts) + choice[at:]


def completion_max_tokens(req: p.CompletionRequest) -> None:
    """max_tokens 0 asks for the prompt alone: with echo only (vLLM's rule)."""
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo: the prompt, scored with logprobs, and no "
                            "completion)", param="max_tokens")


def prompt_logprobs(req: p.CompletionRequest) -> int | None:
    """How many alternatives the prompt's tokens are scored with: echo with logprobs scores them
    (and echo of a prompt alone, max_tokens 0, runs as a scoring request)."""
    if not req.echo:
        return None
    if req.logprobs is not None:
        return req.logprobs
    return 0 if req.max_tokens == 0 else None
