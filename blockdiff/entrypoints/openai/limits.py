"""What one API request may ask of the server's CPU and memory, checked before the expensive work.

- Text: every string that reaches the chat template (message content, roles and names, tool-call
  ids, names and arguments, reasoning, other message fields, tool names, descriptions and
  parameters, chat_template_kwargs) counts, with the keys a template may show. More characters than `max_model_len` tokens can
  cover (`max_model_len` x the longest vocabulary entry) cannot fit, whatever they encode to, and
  are refused before the template or the tokenizer sees them.
- Token-id lists: a `draft` longer than `max_model_len` can seed no canvas past the context, more
  than MAX_STOP_TOKEN_IDS stop ids are refused, and one call may bring at most
  MAX_REQUEST_TOKEN_IDS ids to the engine in all: choices x (prompt + draft + stop_token_ids). The
  choices of a call share one validated copy of each list; these bound what the engine still
  copies and checks per choice.
"""

from __future__ import annotations

from typing import Any

from blockdiff.entrypoints.openai.errors import APIError

MAX_STOP_TOKEN_IDS = 1024
MAX_REQUEST_TOKEN_IDS = 2**22


# Keys of the request's own schema (messages, calls, tools, content parts): templates read their
# values, not their names. Any other key (of parameters, extra message fields, kwargs) may be shown.
_SCHEMA_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning",
                          "thinking", "type", "text", "id", "function", "arguments", "description", "parameters",
                          "strict"})


def text_chars(value: Any) -> int:
    """Characters of every string under `value`, and of the keys a template may show (iterative; the
    body's nesting is bounded already)."""
    total, stack = 0, [value]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            total += sum(len(k) for k in value if isinstance(k, str) and k not in _SCHEMA_KEYS)
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


def check_template_text(messages: list[dict], tools: list[dict] | None, kwargs: dict, max_chars: int,
                        max_model_len: int, token_chars: int) -> None:
    """400 if the text the chat template would read cannot fit in the context."""
    chars = text_chars(messages) + text_chars(tools) + text_chars(kwargs)
    if chars > max_chars:
        raise APIError(400, f"messages: the chat's text (messages, tool calls and their arguments, tools, names) is "
                            f"{chars} characters, which cannot fit in max_model_len={max_model_len} tokens (no token "
                            f"covers more than {token_chars} characters)", param="messages")


def check_token_lists(choices_per_prompt: int, prompt_lengths: list[int], draft: list | None, stop_token_ids: list | None,
                      max_model_len: int) -> None:
    """400 for token-id lists longer than the engine can use, before any is copied or checked."""
    if draft is not None and len(draft) > max_model_len:
        raise APIError(400, f"draft holds {len(draft)} token ids; at most max_model_len={max_model_len} can seed "
                            "canvases", param="draft")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"stop_token_ids holds {len(stop_token_ids)} ids, more than {MAX_STOP_TOKEN_IDS}",
                       param="stop_token_ids")
    shared = len(draft or ()) + len(stop_token_ids or ())
    total = choices_per_prompt * sum(length + shared for length in prompt_lengths)
    if total > MAX_REQUEST_TOKEN_IDS:
        raise APIError(400, f"this request brings {total} token ids to the engine (choices x (prompt + draft + "
                            f"stop_token_ids)), more than {MAX_REQUEST_TOKEN_IDS}: lower n or send fewer prompts",
                       param="n" if choices_per_prompt > 1 else "prompt")
