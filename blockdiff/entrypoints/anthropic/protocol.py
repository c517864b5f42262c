"""Request and response bodies of `/v1/messages`, Anthropic's Messages API, with Anthropic's field names.

The request's own fields are strict, as the other endpoints' are. Content blocks are read more
loosely: clients send an assistant turn back as they got it, and blocks carry fields the server
does not read (`cache_control`, `citations`, `signature`), so a block's unread fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai import responses_protocol as r
from blockdiff.sampling_params import SamplerField

# ---- content blocks of the request ---------------------------------------------------------------


class _Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class Base64Source(_Block):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(_Block):
    type: Literal["url"]
    url: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, URLSource], Field(discriminator="type")]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ToolResultPart = Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Annotated[list[ToolResultPart], Field(max_length=p.MAX_CONTENT_PARTS)] = ""
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(_Block):
    """Anthropic's encrypted thinking, which only Anthropic can read: accepted in a replayed turn, and dropped."""

    type: Literal["redacted_thinking"]


ContentBlock = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                               RedactedThinkingBlock], Field(discriminator="type")]


class Message(p._Request):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(max_length=p.MAX_CONTENT_PARTS)]


# ---- the request's other fields ------------------------------------------------------------------
MIN_THINKING_BUDGET = 1024  # Anthropic's least thinking.budget_tokens


class Tool(p._Request):
    """A client tool. Anthropic's server tools (web search, code execution, ...) and its other
    built-in tools have a `type` of their own and are refused by name: there is nothing here to run
    them, and no schema to show the model."""

    model_config = ConfigDict(strict=True, extra="ignore")  # cache_control, and the tool's other hints
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _not_a_server_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            message = (f"tool {data.get('name')!r} of type {kind!r} is not served: this server runs no Anthropic "
                       f"server tools nor other built-in tool types, only client tools (a name and an input_schema)")
            raise PydanticCustomError("server_tool", "{message}", {"message": message})  # not a template: names may hold braces
        return data


class ToolChoice(p._Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(p._Request):
    type: Literal["enabled", "adaptive", "disabled"]
    # Anthropic's bounds (and less than max_tokens, convert.py); thinking has no budget of its own here
    budget_tokens: int | None = Field(default=None, ge=MIN_THINKING_BUDGET)


class JsonOutputFormat(p._Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class OutputConfig(p._Request):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(p._Request):
    user_id: str | None = None


class CountTokensRequest(r._SamplerExtensions):
    """/v1/messages/count_tokens: the conversation a message request would send."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields: ignored with a warning (body.py)
    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=p.MAX_MESSAGES)
    system: str | Annotated[list[TextBlock], Field(max_length=p.MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=p.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. Beside Anthropic's fields, the sampler fields that /v1/responses takes
    (seed, min_p and the diffusion extensions), as extra body fields."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: Annotated[list[str], Field(max_length=p.MAX_STOP)] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    # vLLM's sampling fields beside Anthropic's
    seed: int | None = None
    min_p: float | None = None


def messages_request_types(table: tuple[SamplerField, ...]) -> tuple[type[MessagesRequest], type[CountTokensRequest]]:
    """The two bodies of a server whose model runs the sampler of field table `table` (as
    protocol.request_types makes the chat body)."""
    extra = {f.name: (f.type | None, None) for f in table if f.name in p.sampler_extensions(table)}
    return (create_model("MessagesRequest", __base__=MessagesRequest, **extra),
            create_model("CountTokensRequest", __base__=CountTokensRequest, **extra))


# ---- response -------------------------------------------------------------------------------------


class TextOut(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class ThinkingOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""  # Anthropic signs its thinking; a client that replays this block sends it back unread


class ToolUseOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextOut | ThinkingOut | ToolUseOut]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int
