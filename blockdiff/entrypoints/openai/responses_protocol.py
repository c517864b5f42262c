"""Request and response bodies of `/v1/responses`, OpenAI's Responses API, with OpenAI's field names.

The request's own fields are strict, as the other endpoints' (an unknown or misspelt field is a
400 naming it). Input items are read a little more loosely: clients send a response's output items
back as they got them (openai-agents replays every field that was set), and the API's output items
keep growing fields (`phase`, `namespace`, ...), so fields of an item that the server does not read
are ignored there. docs/server.md lists what is served and what is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, create_model

from blockdiff.entrypoints.openai import protocol as p
from blockdiff.sampling_params import SamplerField

# ---- input items ---------------------------------------------------------------------------------


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class InputText(_Item):
    type: Literal["input_text"]
    text: str


class InputImage(_Item):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None


class OutputText(_Item):
    type: Literal["output_text"]
    text: str


class Refusal(_Item):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[Union[InputText, InputImage, OutputText, Refusal], Field(discriminator="type")]


def _text_or(items: Any) -> Any:
    """A string or a list of `items`: only the form the value has is validated, so an error in a list
    is reported as that (not as "should be a valid string"). The tags are the names pydantic gives
    the forms, which error messages leave out of a field's path (errors.py)."""
    return Annotated[Union[Annotated[str, Tag("str")], Annotated[items, Tag("list[item]")]],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list[item]")]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: _text_or(Annotated[list[ContentPart], Field(max_length=p.MAX_CONTENT_PARTS)])


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON, as the model's call came out


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: _text_or(Annotated[list[InputText], Field(max_length=p.MAX_CONTENT_PARTS)])


class ReasoningText(_Item):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Item):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


def _item_type(value: Any) -> str | None:
    """An item's tag: its `type`, "message" when a message leaves it out (OpenAI's easy form)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_type, custom_error_type="invalid_item",
                  custom_error_message="an input item's type must be message, function_call, function_call_output or "
                                       "reasoning; the other items belong to OpenAI's hosted tools, which this server "
                                       "does not have"),
]

# ---- request -------------------------------------------------------------------------------------


class FunctionTool(p.FunctionDefinition):
    """A function tool: the chat API's function definition, flat, beside its type."""

    type: Literal["function"]


class HostedTool(BaseModel):
    """One of OpenAI's own tools (web_search, file_search, mcp, ...): refused, by its type."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str


ToolParam = Annotated[
    Union[Annotated[FunctionTool, Tag("function")], Annotated[HostedTool, Tag("hosted")]],
    Discriminator(lambda v: "function" if (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) == "function"
                  else "hosted"),
]


class FunctionChoice(p._Request):
    type: Literal["function"]
    name: str


class ReasoningConfig(p._Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries are written: see docs
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # OpenAI's older name of summary


class TextFormat(BaseModel):
    """`text.format`: only {"type": "text"} is served; the structured formats carry more fields."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_schema", "json_object"]


class TextConfig(p._Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# Sampler fields a request may set beside OpenAI's (as on the chat endpoint): the diffusion
# extensions and vLLM's sampling fields. Drafts are the chat and completion streams' own events.
EXTENSIONS = tuple(name for name in p.SAMPLER_EXTENSIONS if name not in ("stream_drafts", "draft_details"))
_SamplerExtensions = create_model(
    "_ResponsesSamplerExtensions", __base__=p._Request,
    **{name: (p._SamplerExtensions.model_fields[name].annotation, None) for name in EXTENSIONS},
)


class ResponsesStreamOptions(p._Request):
    include_obfuscation: bool | None = None  # nothing is obfuscated: the events carry no padding


class ResponsesRequest(_SamplerExtensions):
    model: str | None = None
    input: _text_or(Annotated[list[InputItem], Field(max_length=p.MAX_MESSAGES)]) | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # default true, as OpenAI's
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: Annotated[list[ToolParam], Field(max_length=p.MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None  # refused: OpenAI's Conversations API
    prompt: dict[str, Any] | None = None  # refused: OpenAI's stored prompt templates
    top_logprobs: int | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's sampling fields beside OpenAI's
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | Annotated[list[str], Field(max_length=p.MAX_STOP)] | None = None


def responses_request_type(table: tuple[SamplerField, ...]) -> type[ResponsesRequest]:
    """The /v1/responses body of a server whose model runs the sampler of field table `table`
    (as protocol.request_types makes the chat body)."""
    extra = {f.name: (f.type | None, None) for f in table if f.name in p.sampler_extensions(table)}
    return create_model("ResponsesRequest", __base__=ResponsesRequest, **extra)


# ---- response ------------------------------------------------------------------------------------


class OutputTextPart(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputTextPart] = Field(default_factory=list)


class OutputReasoning(BaseModel):
    """The model's thinking, whole, as `content` (OpenAI's open-weight form); no summary is written."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "in_progress"
    summary: list = Field(default_factory=list)
    content: list[ReasoningTextPart] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = Union[OutputMessage, OutputReasoning, OutputFunctionCall]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    diffusion: p.DiffusionUsage  # the extension the other endpoints' usage carries


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[FunctionTool]
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice
    parallel_tool_calls: bool
    reasoning: ReasoningConfig | None
    text: TextConfig
    truncation: Literal["disabled"] = "disabled"
    store: bool
    background: bool = False
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None = None
    error: None = None  # a failed request is an error answer or an `error` event, not a stored response
    incomplete_details: IncompleteDetails | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
