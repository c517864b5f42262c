"""A Messages request as the chat request it is, and a chat output's end as Anthropic's stop reason.

The conversation becomes chat messages: `system` a system message first; an assistant turn's text
its content, its `thinking` blocks its `reasoning_content` and its `tool_use` blocks its
`tool_calls`; a user turn's `tool_result` blocks `tool` messages (their images a user message after
them), its text and images one user message. Tools, `tool_choice`, `thinking`, `stop_sequences`
and the sampling fields become the chat request's fields, which the chat endpoint then checks.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from blockdiff.entrypoints.anthropic import protocol as a
from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai import responses_protocol as r
from blockdiff.entrypoints.openai.errors import APIError, renamed_params
from blockdiff.outputs import RequestOutput

# The chat request's names of the fields whose errors a Messages request knows by other names.
_MESSAGES_NAMES = {"stop": "stop_sequences", "reasoning_effort": "thinking", "prompt": "messages",
                   "response_format": "output_config.format"}
# Fields a Messages request passes to its chat request as they are.
_CHAT_FIELDS = ("model", "stream", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")
# The chat template's effort for `thinking` on without `output_config.effort`: any effort but "none"
# and "minimal" turns a template's switch on; a template that reads the effort itself gets OpenAI's
# default. Anthropic's "max" is the chat API's highest.
_THINKING_EFFORT = "medium"
_EFFORTS = {"max": "xhigh"}


def messages_names():
    """Errors of the chat machinery, about fields under their chat names, under the Messages names."""
    return renamed_params(_MESSAGES_NAMES)


def chat_request(req: a.CountTokensRequest, chat_type: type[p.ChatCompletionRequest],
                 extensions: tuple[str, ...]) -> p.ChatCompletionRequest:
    """The server's chat request (`chat_type`) that `req` is; `extensions`: the sampler fields both take."""
    messages = chat_messages(req)
    if len(messages) > p.MAX_MESSAGES:
        raise APIError(400, f"the conversation has {len(messages)} chat messages, more than the {p.MAX_MESSAGES} one "
                            "request may hold", param="messages")
    body = {name: getattr(req, name) for name in (*_CHAT_FIELDS, *r.EXTENSIONS, *extensions)
            if getattr(req, name, None) is not None}
    body["messages"] = messages
    if getattr(req, "stop_sequences", None):
        body["stop"] = req.stop_sequences
    metadata = getattr(req, "metadata", None)
    if metadata is not None and metadata.user_id is not None:
        body["user"] = metadata.user_id
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                             **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    if req.tool_choice is not None:
        body.update(_tool_choice(req.tool_choice))
    _check_budget(req)
    effort = _effort(req)
    if effort is not None:
        body["reasoning_effort"] = effort
    output_format = req.output_config.format if req.output_config is not None else None
    if output_format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": output_format.schema_}}
    try:
        return chat_type.model_validate(body)
    except ValidationError as e:  # the request was valid; what it adds up to may not be
        error = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in error["loc"])
        raise APIError(400, f"{where} (of the chat request this request becomes): {error['msg']}") from None


def _check_budget(req: a.CountTokensRequest) -> None:
    """Anthropic's bounds beside the protocol's: thinking of type "enabled" has a budget, and it is
    less than max_tokens (which count_tokens has not)."""
    budget = req.thinking.budget_tokens if req.thinking is not None else None
    if budget is None and req.thinking is not None and req.thinking.type == "enabled":
        raise APIError(400, 'thinking.budget_tokens: Field required (thinking of type "enabled" takes a budget)',
                       param="thinking")
    max_tokens = getattr(req, "max_tokens", None)
    if budget is not None and max_tokens is not None and budget >= max_tokens:
        raise APIError(400, f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                       param="thinking")


def _effort(req: a.CountTokensRequest) -> str | None:
    """The chat request's reasoning_effort, which sets the chat template's thinking switch: `thinking`
    disabled is "none"; else `output_config.effort`, or with `thinking` on and no effort the default."""
    if req.thinking is not None and req.thinking.type == "disabled":
        return "none"
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None:
        return _EFFORTS.get(effort, effort)
    return _THINKING_EFFORT if req.thinking is not None else None


def _tool_choice(choice: a.ToolChoice) -> dict:
    fields: dict = {}
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "tool_choice: type 'tool' needs the tool's name", param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def chat_messages(req: a.CountTokensRequest) -> list[dict]:
    if isinstance(req.system, list):
        system = "".join(block.text for block in req.system)
    else:
        system = req.system
    messages = [] if not system else [{"role": "system", "content": system}]
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant(i, message.content))
        else:
            messages += _user(i, message.content)
    return messages


def _assistant(i: int, blocks: list) -> dict:
    turn: dict = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        if isinstance(block, a.TextBlock):
            turn["content"] += block.text
        elif isinstance(block, a.ThinkingBlock):
            turn["reasoning_content"] = turn.get("reasoning_content", "") + block.thinking
        elif isinstance(block, a.ToolUseBlock):
            turn.setdefault("tool_calls", []).append(
                {"id": block.id, "type": "function",
                 "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, a.RedactedThinkingBlock):
            raise APIError(400, f"messages[{i}].content[{j}]: an assistant message holds text, thinking and "
                                f"tool_use blocks, not {block.type!r}", param="messages")
    return turn


def _user(i: int, blocks: list) -> list[dict]:
    """A user turn's chat messages: one `tool` message per tool_result, in order (with a user message
    of its images after it: a tool message holds text), then its text and images."""
    messages, parts = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, a.ToolResultBlock):
            content = [block.content] if isinstance(block.content, str) else block.content
            text = "".join(part.text if isinstance(part, a.TextBlock) else part for part in content
                           if not isinstance(part, a.ImageBlock))
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
            images = [_image(part) for part in content if isinstance(part, a.ImageBlock)]
            if images:
                messages.append({"role": "user", "content": images})
        elif isinstance(block, a.TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, a.ImageBlock):
            parts.append(_image(block))
        else:
            raise APIError(400, f"messages[{i}].content[{j}]: a user message holds text, image and tool_result "
                                f"blocks, not {block.type!r}", param="messages")
    if parts:
        messages.append({"role": "user", "content": parts})
    return messages


def _image(block: a.ImageBlock) -> dict:
    """An image block as the chat endpoint's image_url part, which loads it under the server's image limits."""
    source = block.source
    url = source.url if isinstance(source, a.URLSource) else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def stop_reason(out: RequestOutput, called: bool) -> tuple[a.StopReason, str | None]:
    """-> (Anthropic's stop reason, the stop sequence that ended the text, if one did)."""
    if called:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    matched = out.outputs[0].stop_reason  # a stop string, or the id of the stop token (EOS)
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None
