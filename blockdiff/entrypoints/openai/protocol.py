"""Request and response bodies of the OpenAI-compatible API, with OpenAI's field names.

Requests are validated strictly (no "5" for 5, no true for 1). Unknown top-level fields of the
generation bodies are ignored with a warning naming them, as vLLM does (`--strict-request-fields`
refuses them with a 400 instead); unknown fields inside them are refused. The diffusion extensions
(max_denoising_steps, ..., stream_drafts, return_token_ids) are extra body fields; see docs/server.md.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from blockdiff.sampling_params import ENGINE_FIELDS, SamplerField, SamplingParams


# Bounds on the lists a request may hold, so validation time and memory stay bounded (see body.py
# for the bound on JSON objects).
MAX_CHOICES = 2048  # engine requests (prompts x n) one API call may start, so also its prompts
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_STOP = 16
MAX_TOOLS = 128


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk


# Fields a request may set directly for any model (diffusion extensions), typed as in SamplingParams:
# the per-canvas fields every sampler has, and a few more. The fields of the model's sampler's
# table come on top (`request_types`).
SAMPLER_EXTENSIONS = (*(f.name for f in ENGINE_FIELDS if f.per_canvas), "ignore_eos", "draft", "stop_token_ids",
                      "stream_drafts", "draft_details")
# OpenAI/vLLM sampling fields, passed to SamplingParams, which says what it supports.
VLLM_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                 "include_stop_str_in_output", "cache_salt", "allowed_token_ids", "bad_words")
# Fields of OpenAI's and vLLM's that change nothing here: accepted, and named in a warning when set.
IGNORED_FIELDS = ("store", "service_tier", "prompt_cache_key", "safety_identifier", "verbosity", "modalities",
                  "prediction")
_hints = get_type_hints(SamplingParams)
_SamplerExtensions = create_model(
    "_SamplerExtensions", __base__=_Request, **{name: (_hints[name] | None, None) for name in SAMPLER_EXTENSIONS}
)


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's structured_outputs: exactly one of these (docs/structured_outputs.md)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class _GenerationRequest(_SamplerExtensions):
    """Fields both endpoints accept; other top-level fields land in `model_extra` (ignored, or refused
    with --strict-request-fields)."""

    model_config = ConfigDict(strict=True, extra="allow")

    # Structured outputs (OpenAI's response_format; vLLM's structured_outputs and its older guided_*)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    model: str | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as strings) -> bias
    user: str | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None  # OpenAI's: stored nowhere, so ignored
    return_token_ids: bool | None = None  # extension: token ids in every choice and chunk
    min_tokens: int | None = None  # vLLM's: no EOS, stop token or stop string before this many tokens
    skip_special_tokens: bool | None = None  # vLLM's; unset: true, and false where a chat's output is parsed
    # vLLM's request fields (docs/server.md, "vLLM's request fields")
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: the context's length
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # the response's id: <prefix>-<request_id>
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens spelled "token_id:<id>"
    add_special_tokens: bool | None = None  # BOS before the prompt: default true for a prompt, false for a chat
    use_beam_search: bool | None = None  # only false: a diffusion canvas has no beams
    priority: int | None = None  # only 0: requests are served first come, first served
    cache_salt: str | None = None  # prefix-cache entries shared only with requests of the same salt
    # vLLM's vocabulary restrictions (blockdiff/structured/restrictions.py): only these tokens are
    # generated (an EOS not among them never ends the output); no output holds one of these words
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # OpenAI's fields that change nothing here (IGNORED_FIELDS)
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: dict[str, Any] | None = None


def ignored_fields(req: BaseModel) -> list[str]:
    """The fields of IGNORED_FIELDS that a completion or chat request sets (the Responses API's
    `store`, say, means something there)."""
    return [f for f in IGNORED_FIELDS if getattr(req, f) is not None] if isinstance(req, _GenerationRequest) else []


class CompletionRequest(_GenerationRequest):
    prompt: str | Annotated[list[str], Field(max_length=MAX_CHOICES)] | list[int] | Annotated[list[list[int]], Field(max_length=MAX_CHOICES)]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None  # the prompt before the completion, with logprobs its tokens' scores
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCallIn(_Request):
    """A call of an earlier assistant message, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Other keys pass through to the chat template.
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this result answers
    reasoning_content: str | None = None  # assistant: its thinking (vLLM's name)
    reasoning: str | None = None  # the same, under vLLM's newer name


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_shape(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        """The parts of a JSON schema that chat templates walk have the shape JSON Schema gives them."""
        if schema is None:
            return schema
        properties = schema.get("properties")
        if properties is not None and not (isinstance(properties, dict) and all(isinstance(v, dict) for v in properties.values())):
            raise ValueError("properties must be an object of schemas, one per argument")
        required = schema.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(v, str) for v in required)):
            raise ValueError("required must be a list of argument names")
        return schema


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables the chat template reads (enable_thinking)
    # OpenAI's; thinking on or off through the template's switch (docs/server.md, "Tool calls and thinking")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    echo: bool | None = None  # vLLM's: the reply starts with the last message's content when it is the assistant's
    add_generation_prompt: bool | None = None  # vLLM's; default true
    continue_final_message: bool | None = None  # vLLM's: the reply continues the last (assistant) message
    chat_template: str | None = None  # vLLM's: the request's own template (with --trust-request-chat-template)
    documents: Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES)] | None = None  # the template's `documents`
    # vLLM's: the prompt's tokens scored, with this many alternatives each (the response's prompt_logprobs)
    prompt_logprobs: int | None = None


def sampler_extensions(table: tuple[SamplerField, ...]) -> tuple[str, ...]:
    """The extension fields a sampler's table adds to the generation bodies: its fields that they
    do not have already."""
    return tuple(f.name for f in table if f.name not in CompletionRequest.model_fields)


def request_types(table: tuple[SamplerField, ...]) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The two generation bodies of a server whose model runs the sampler of field table `table`:
    its fields are accepted (and documented) there, another sampler's are unknown fields."""
    extra = {f.name: (f.type | None, None) for f in table if f.name in sampler_extensions(table)}
    return (create_model("CompletionRequest", __base__=CompletionRequest, **extra),
            create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, **extra))


# ---- responses ----------------------------------------------------------------------------------
def new_id(prefix: str, given: str | None = None) -> str:
    """A response's id: the request's own `request_id` (vLLM's field) after the prefix, else a random one."""
    return f"{prefix}-{given if given is not None else uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class DiffusionUsage(BaseModel):
    canvases: int = 0
    denoising_steps: int = 0
    canvas_positions_evaluated: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV cache was reused (prefix caching)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    diffusion: DiffusionUsage = Field(default_factory=DiffusionUsage)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token, which nothing scores (echo)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # None in stream chunks


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaToolCall(ToolCallOut):
    index: int  # the call's place among the choice's calls; a call arrives whole, in one chunk


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # The thinking, under both of vLLM's names (its older reasoning_content and its newer reasoning).
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: a prompt token's (or an alternative's) log-probability, its rank (1: the most
    likely; None where unknown) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's, with the request's prompt_logprobs: per prompt token, {token id: its score and each
    # alternative's}; None for the first token, which nothing scores
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class DraftChoice(BaseModel):
    index: int
    canvas: int  # 0-based index of the canvas being denoised
    denoising_steps: int  # steps of this request so far
    token_ids: list[int]  # the argmax canvas after the latest step
    text: str | None
    # With draft_details: each token decoded alone, and per position the step's entropy (nats) and
    # whether the step kept its sampled token (false: renoised).
    tokens: list[str] | None = None
    entropy: list[float] | None = None
    accepted: list[bool] | None = None


class DraftEvent(BaseModel):
    """Extension: `event: draft` in the SSE stream when stream_drafts is true."""

    id: str
    object: Literal["text_completion.draft", "chat.completion.draft"]
    created: int
    model: str
    choices: list[DraftChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "blockdiff"
    root: str
    max_model_len: int
    parent: str | None = None  # an adapter's base model (vLLM's)
    canvas_length: int  # tokens denoised together
    # Sampler fields as a request that leaves them unset gets them (max_tokens None: what fits)
    sampling_defaults: dict[str, int | float | str | None]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- /tokenize and /detokenize (vLLM's shapes; entrypoints/openai/tokenization.py) ------------------
class TokenizeRequest(_Request):
    """vLLM's two request forms in one model: `prompt` (a completion prompt) or `messages` (a chat,
    through the chat template); the chat-only fields are refused with a prompt."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template writes BOS)
    add_generation_prompt: bool | None = None  # messages only; default true
    continue_final_message: bool | None = None  # messages only; default false
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # messages only, as the chat endpoint's
    chat_template_kwargs: dict[str, Any] | None = None  # messages only, as the chat endpoint's
    return_token_strs: bool | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
