"""The generation endpoints: an API request becomes engine requests, their outputs become OpenAI
responses or server-sent events (one chunk per committed canvas)."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields, replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from blockdiff.diffusion.registry import SAMPLERS
from blockdiff.engine.async_engine import EngineUnavailable, RequestFailed, RequestStream
from blockdiff.engine.client import EngineClient, structured_specs
from blockdiff.chat_parts import IMAGE_PART_TYPES, template_content
from blockdiff.engine.images import PromptImages
from blockdiff.image import ImageError
from blockdiff.entrypoints.openai import limits, protocol as p
from blockdiff.entrypoints.openai.body import MAX_JSON_VALUES, Budget, decode_json
from blockdiff.entrypoints.openai.chat_output import ChatOutput, OutputRules
from blockdiff.entrypoints.openai.clients import ClientLimit, client_of
from blockdiff.entrypoints.openai.errors import APIError, bad_value, error_body
from blockdiff.entrypoints.openai.media import ChatImages
from blockdiff.entrypoints.openai.preprocess import WorkPool, check_deadline
from blockdiff.entrypoints.openai import reasoning, tool_parsers, vllm_fields
from blockdiff.entrypoints.openai.structured import constraint_field, request_constraint, tool_call_constraint
from blockdiff.outputs import RequestOutput, TokenLogprob
from blockdiff.sampling_params import MAX_LOGPROBS, ResolvedParams, SamplingParams

log = logging.getLogger(__name__)

MAX_N = 128  # choices per prompt (OpenAI's limit)
REQUEST_FIELDS = set(p.CompletionRequest.model_fields) | set(p.ChatCompletionRequest.model_fields) | {
    f.name for f in fields(SamplingParams)
} | {f.name for sampler in SAMPLERS.values() for f in sampler.fields}


@dataclass
class Piece:
    """What one chunk adds to a choice (or, from a fresh ChoiceState, the whole choice)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's scores (echo), in a choice's first piece


class ChoiceState:
    """What has been sent of one choice. The engine sends deltas (output_kind "delta"), with text
    that may still change held back (see engine/detokenizer.py)."""

    def __init__(self):
        self.canvases = 0

    def is_draft(self, out: RequestOutput) -> bool:
        return not out.finished and out.metrics["canvases"] == self.canvases

    def advance(self, out: RequestOutput) -> Piece:
        self.canvases = out.metrics["canvases"]
        return Piece(text=out.text or "", token_ids=out.token_ids, logprobs=out.outputs[0].token_logprobs,
                     finish_reason=out.finish_reason if out.finished else None, prompt_logprobs=out.prompt_token_logprobs)


def usage(prompts: list[list[int]], finals: dict[int, RequestOutput], choices: int) -> p.Usage:
    """Each prompt counts once, however many choices it has (choice i is of prompt i // per prompt);
    so do its cached tokens, the most any of its choices found."""
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion = sum(o.metrics["committed_tokens"] for o in finals.values())  # outputs may be deltas
    diffusion = p.DiffusionUsage(**{k: sum(o.metrics[k] for o in finals.values()) for k in p.DiffusionUsage.model_fields})
    per_prompt = max(1, choices // len(prompts))
    cached: dict[int, int] = {}
    for i, o in finals.items():
        cached[i // per_prompt] = max(cached.get(i // per_prompt, 0), o.num_cached_tokens)
    return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                   prompt_tokens_details=p.PromptTokensDetails(cached_tokens=sum(cached.values())), diffusion=diffusion)


class _Format:
    """How one endpoint spells its chunks and responses."""

    draft_object: str

    def __init__(self, serving: OpenAIServing, request_id: str, model: str, return_token_ids: bool):
        self.serving, self.id, self.model, self.created = serving, request_id, model, p.now()
        self.return_token_ids = return_token_ids

    def _ids(self, piece: Piece) -> list[int] | None:
        return piece.token_ids if self.return_token_ids else None

    def begin(self, count: int) -> list[BaseModel]:
        return []


class _CompletionFormat(_Format):
    draft_object = "text_completion.draft"

    def __init__(self, serving, request_id, model, return_token_ids, logprobs: int | None,
                 echo: list[tuple[str, list[int]]] | None = None, n: int = 1):
        super().__init__(serving, request_id, model, return_token_ids)
        self.logprobs = logprobs
        self.echo, self.n = echo, n  # echo: each prompt's text and ids, which its choices start with
        # text_offset runs over the token strings sent so far, per choice; it is not the text sent,
        # which lags behind the tokens while a stop string may still cut it.
        self._offsets: dict[int, int] = {}

    def _choice(self, index: int, piece: Piece) -> p.CompletionChoice:
        first = index not in self._offsets
        offset = self._offsets.setdefault(index, 0)
        echo = self.echo[index // self.n] if self.echo is not None and first else None  # in a choice's first piece
        text = piece.text if echo is None else echo[0] + piece.text
        lp = None
        if self.logprobs is not None:
            top = self.logprobs > 0
            head = None if echo is None else vllm_fields.echo_logprobs(echo[1], piece.prompt_logprobs,
                                                                        self.serving.token_text, top)
            start = offset + (0 if head is None else sum(map(len, head.tokens)))
            lp = self.serving.completion_logprobs(piece.logprobs or [], start, top)
            self._offsets[index] = start + sum(map(len, lp.tokens))
            lp = lp if head is None else vllm_fields.joined(head, lp)
        return p.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=piece.finish_reason,
                                  token_ids=self._ids(piece))

    def chunk(self, index: int, piece: Piece) -> BaseModel:
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[self._choice(index, piece)])

    def usage_chunk(self, u: p.Usage) -> BaseModel:
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=u)

    def response(self, pieces: dict[int, Piece], u: p.Usage) -> BaseModel:
        choices = [self._choice(i, pieces[i]) for i in sorted(pieces)]
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)


class _ChatFormat(_Format):
    draft_object = "chat.completion.draft"

    def __init__(self, serving, request_id, model, return_token_ids, logprobs: bool, rules: OutputRules,
                 echo: str | None = None):
        super().__init__(serving, request_id, model, return_token_ids)
        self.logprobs = logprobs
        self.rules = rules
        self.echo = echo  # vLLM's chat echo: the last (assistant) message's content, which each reply starts with
        self._outputs: dict[int, ChatOutput] = {}

    def _parse(self, index: int, piece: Piece):
        """-> (what the piece adds: reasoning, content, calls; the choice's calls so far; finish reason)."""
        output = self._outputs.setdefault(index, ChatOutput(self.rules))
        first_call = len(output.calls)
        parsed = output.feed(piece.text, piece.finish_reason is not None)
        return parsed, first_call, output.finish_reason(piece.finish_reason)

    def _logprobs(self, piece: Piece) -> p.ChatLogprobs | None:
        return self.serving.chat_logprobs(piece.logprobs or []) if self.logprobs else None

    def _chunk(self, choices: list[p.ChatChunkChoice], u: p.Usage | None = None) -> BaseModel:
        return p.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)

    def begin(self, count: int) -> list[BaseModel]:
        return [self._chunk([p.ChatChunkChoice(index=i, delta=p.Delta(role="assistant", content=self.echo or ""))])
                for i in range(count)]

    def chunk(self, index: int, piece: Piece) -> BaseModel:
        parsed, first_call, finish_reason = self._parse(index, piece)
        calls = [p.DeltaToolCall(index=first_call + k, id=c.id, function=p.FunctionCallOut(name=c.name, arguments=c.arguments_json))
                 for k, c in enumerate(parsed.calls)]
        delta = p.Delta(content=parsed.content, reasoning_content=parsed.reasoning or None,
                        reasoning=parsed.reasoning or None, tool_calls=calls or None)
        choice = p.ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(piece), finish_reason=finish_reason,
                                   token_ids=self._ids(piece))
        return self._chunk([choice])

    def usage_chunk(self, u: p.Usage) -> BaseModel:
        return self._chunk([], u)

    def _choice(self, index: int, piece: Piece) -> p.ChatChoice:
        parsed, _, finish_reason = self._parse(index, piece)
        calls = [p.ToolCallOut(id=c.id, function=p.FunctionCallOut(name=c.name, arguments=c.arguments_json)) for c in parsed.calls]
        # As vLLM: no content beside calls when the text outside them is blank, or thinking took it all.
        content = None if (calls or parsed.reasoning) and not parsed.content.strip() else parsed.content
        if self.echo:
            content = self.echo + (content or "")
        message = p.AssistantMessage(content=content, reasoning_content=parsed.reasoning or None,
                                     reasoning=parsed.reasoning or None, tool_calls=calls)
        return p.ChatChoice(index=index, message=message, logprobs=self._logprobs(piece), finish_reason=finish_reason,
                            token_ids=self._ids(piece))

    def response(self, pieces: dict[int, Piece], u: p.Usage) -> BaseModel:
        choices = [self._choice(i, pieces[i]) for i in sorted(pieces)]
        return p.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)


def _sse(model: BaseModel | dict, event: str | None = None) -> str:
    data = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends (finished, client gone,
    cancelled before the first byte), and drops its connection once the client has left more of
    it unread than the stream's bound (`stream.overflowed`): a client that does not read would
    otherwise have the outputs queued for it until it hangs up."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream, self._on_close = stream, on_close

    async def __call__(self, scope, receive, send) -> None:
        response = asyncio.ensure_future(super().__call__(scope, receive, send))
        overflowed = asyncio.ensure_future(self._stream.overflowed.wait())
        try:
            await asyncio.wait({response, overflowed}, return_when=asyncio.FIRST_COMPLETED)
            if not self._stream.overflowed.is_set():
                return response.result()
            # The events end with StreamOverflow, or wait on a client that does not read: drop it.
            log.warning("dropping a stream whose client left more than %d bytes of it unread (--max-stream-buffer)",
                        self._stream.max_unread)
            drop = scope.get("extensions", {}).get("blockdiff.drop_connection")  # connections.py's protocol
            if drop is not None:
                drop()
                await asyncio.sleep(0)  # the connection is lost before the app returns: no complaint from uvicorn
        finally:
            for task in (response, overflowed):
                task.cancel()
            if response.done() and not response.cancelled():
                response.exception()  # retrieved: the overflow it may hold is handled above
            self._on_close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _prompt_list(prompt: str | list) -> list:
    """A completion request's prompts, each a string or token ids."""
    return [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)


def _prompt_count(prompt: str | list) -> int:
    """Prompts in a completion request's `prompt`, counted before any is tokenized."""
    return len(_prompt_list(prompt))


def _request_names(req: p._GenerationRequest) -> dict[str, str]:
    """The request fields that engine errors about `prompt`, `max_tokens` and `structured_outputs` are about."""
    field = constraint_field(req)
    if field is None and isinstance(req, p.ChatCompletionRequest) and req.tool_choice not in (None, "none", "auto"):
        field = "tool_choice"
    names = {} if field is None else {"structured_outputs": field}
    if not isinstance(req, p.ChatCompletionRequest):
        return names
    names["prompt"] = "messages"
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


def _prompt_length(prompt: list[int] | PromptImages) -> int:
    """Tokens of an engine prompt, each image counting its expanded placeholder."""
    return len(prompt.token_ids if isinstance(prompt, PromptImages) else prompt)


def _check_choices(prompts: int, n: int) -> None:
    if prompts * n > p.MAX_CHOICES:
        raise APIError(400, f"{prompts} prompts x n={n} = {prompts * n} choices, more than the {p.MAX_CHOICES} one "
                            "request may ask for", param="prompt" if n == 1 else "n")


def _decode_arguments(messages: list[dict]) -> None:
    """The arguments of earlier tool calls, JSON text as OpenAI clients send them, decoded in place
    into objects (vLLM decodes them too, so templates can format each argument): all of a request's
    within one budget of containers and nesting, their strings checked as the body's are."""
    budget = Budget(max_items=MAX_JSON_VALUES)  # no list of their own is too long: their text is bounded already
    for i, message in enumerate(messages):
        for k, call in enumerate(message.get("tool_calls", [])):
            what = f"messages[{i}].tool_calls[{k}].function.arguments"
            try:
                call["function"]["arguments"] = decode_json(call["function"]["arguments"], what, budget)
            except json.JSONDecodeError as e:
                raise APIError(400, f"{what} is not JSON: {e}", param="messages") from None
            except APIError as e:
                raise APIError(400, e.message, param="messages") from None


# Names the server gives the chat template itself; chat_template_kwargs may not set them.
_SERVER_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                        "eos_token", "unk_token"})


class OpenAIServing:
    def __init__(self, engine: EngineClient, served_model_names: list[str], max_request_cost: int | None,
                 tool_call_parser: str | None, reasoning_parser: str | None, pool: WorkPool, images: ChatImages,
                 clients: ClientLimit, max_stream_buffer: int, default_chat_template_kwargs: dict | None = None):
        """default_chat_template_kwargs: vLLM's --default-chat-template-kwargs, under each request's own."""
        self.engine = engine
        # The CPU work of a request (tokenizer, chat template, their checks) runs in `pool`
        # (preprocess.py), its images in `images` (media.py); `clients` counts its engine requests.
        self.pool = pool
        self.images = images
        self.clients = clients
        self.max_stream_buffer = max_stream_buffer  # bytes a stream's client may leave unread
        self.limits = engine.limits
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names
        self.sampler_extensions = p.sampler_extensions(engine.sampler.fields)  # what the bodies add
        self.tool_parser = self._parser("tool-call", tool_call_parser, tool_parsers.tool_call_parser,
                                        tool_parsers.Gemma4ToolParser)
        self.reasoning_parser = self._parser("reasoning", reasoning_parser, reasoning.reasoning_parser,
                                             reasoning.Gemma4ReasoningParser)
        # By default, one API request may ask for a full batch of the largest requests this server allows.
        largest = SamplingParams(max_tokens=self.limits.max_model_len, max_denoising_steps=self.limits.max_denoising_steps)
        self.max_request_cost = max_request_cost or self.limits.max_num_seqs * engine.cost(largest)
        # Longer text cannot fit in the context, whatever it encodes to; it is refused before the
        # tokenizer (which holds the GIL, stalling every other request) sees it.
        self.max_prompt_chars = None if self.tokenizer is None else self.limits.max_model_len * self.tokenizer.max_token_chars
        self.default_template_kwargs = {}
        if default_chat_template_kwargs:
            if self.tokenizer is None:
                raise ValueError("--default-chat-template-kwargs: this checkpoint has no tokenizer, so no chat template")
            try:
                self.default_template_kwargs = self._template_kwargs(default_chat_template_kwargs)
            except APIError as e:
                raise ValueError(f"--default-chat-template-kwargs: {e.message}") from None

    def _parser(self, kind: str, name: str | None, by_name, checkpoint_format):
        """The parser named by the server flag; with none named, the checkpoint's own format when its
        tokenizer has that format's markers (Gemma 4's), else no parsing."""
        def has(marker: str) -> bool:
            return self.tokenizer is not None and self.tokenizer.token_to_id(marker) is not None

        if name is None:
            return checkpoint_format if all(map(has, checkpoint_format.markers())) else None
        parser = by_name(name)
        missing = [m for m in parser.markers() if not has(m)]
        if missing:
            raise ValueError(f"--{kind}-parser {name}: the checkpoint's tokenizer has no token {missing[0]!r}, so its "
                             f"output cannot be in that format")
        return parser

    # ---- endpoints --------------------------------------------------------------------------
    async def completions(self, req: p.CompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        n = self._check_common(req)
        vllm_fields.completion_max_tokens(req)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, n):
            raise APIError(400, f"best_of must equal n ({n}): candidates are not ranked", param="best_of")
        _check_choices(_prompt_count(req.prompt), n)
        request_id = p.new_id("cmpl")
        constraint = request_constraint(req)
        prompts, requests, echo = await self.pool.run(client_of(raw), self._completion_requests, req, n, request_id,
                                                      constraint)
        fmt = _CompletionFormat(self, request_id, model, bool(req.return_token_ids), req.logprobs, echo, n)
        return await self._respond(req, prompts, requests, fmt, raw)

    def _completion_requests(self, req: p.CompletionRequest, n: int, request_id: str, constraint):
        """(In the pool) -> (the prompts' ids, the engine requests, with echo each prompt's text and ids)."""
        prompts = self._completion_prompts(req.prompt, request_id)
        requests = self._engine_requests(req, prompts, prompts, n, req.max_tokens, req.logprobs,
                                         prompt_logprobs=vllm_fields.prompt_logprobs(req), structured_outputs=constraint)
        echo = [(self._prompt_text(x, ids), ids) for x, ids in zip(_prompt_list(req.prompt), prompts)] if req.echo else None
        return prompts, requests, echo

    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        n = self._check_common(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rules = self._output_rules(req)
        constraint = self._chat_constraint(req, rules)
        request_id = p.new_id("chatcmpl")
        images = await self._chat_images(req.messages, client_of(raw))
        prompts, requests = await self.pool.run(client_of(raw), self._chat_requests, req, images, n, max_tokens, logprobs,
                                                rules, request_id, constraint)
        last = req.messages[-1]
        echo = last.content if req.echo and last.role == "assistant" and isinstance(last.content, str) else None
        fmt = _ChatFormat(self, request_id, model, bool(req.return_token_ids), bool(req.logprobs), rules, echo)
        return await self._respond(req, prompts, requests, fmt, raw)

    def _chat_requests(self, req: p.ChatCompletionRequest, images: list, n: int, max_tokens: int | None,
                       logprobs: int | None, rules: OutputRules, request_id: str, constraint=None):
        """(In the pool) -> (the prompt ids usage counts, the engine requests)."""
        kwargs = req.chat_template_kwargs
        if req.reasoning_effort is not None and self.tokenizer is not None:
            kwargs = vllm_fields.reasoning_kwargs(req.reasoning_effort, self.tokenizer.template_variables, kwargs or {})
        ids = self._chat_prompt(req.messages, request_id, tools=req.tools, chat_template_kwargs=kwargs)
        prompt, prompts = self._with_images(ids, images)
        # The parsers read the format's markers, which are special tokens (vLLM's parsers do the same).
        return prompts, self._engine_requests(req, [prompt], prompts, n, max_tokens, logprobs,
                                              skip_special_tokens=not rules.parses, structured_outputs=constraint)

    @staticmethod
    def _chat_constraint(req: p.ChatCompletionRequest, rules: OutputRules):
        """What the chat's output must be: its structured output, or with a forced tool_choice the
        calls, their arguments as the tools' parameter schemas say; None: anything."""
        constraint = request_constraint(req)
        if rules.forced:
            if constraint is not None:
                raise APIError(400, "a forced tool_choice and a structured output both constrain the output: give one",
                               param="tool_choice")
            constraint = tool_call_constraint(req.tools, rules.allowed, rules.parallel)
        return constraint

    def _output_rules(self, req: p.ChatCompletionRequest) -> OutputRules:
        """Which parsers read this request's output, and what its tool_choice demands."""
        choice = req.tool_choice
        if choice is not None and not req.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        names = {t.function.name for t in req.tools or ()}
        if len(names) < len(req.tools or ()):
            raise APIError(400, "tools: two tools have the same name", param="tools")
        allowed = None
        if isinstance(choice, p.NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                    f"({', '.join(sorted(names))})", param="tool_choice")
            allowed = frozenset({choice.function.name})
        elif choice == "required":
            allowed = frozenset(names)
        parse_calls = bool(req.tools) and choice != "none"
        if parse_calls and self.tool_parser is None:
            if allowed is not None or choice == "auto":
                raise APIError(400, "tool calls cannot be read from this model's output: start the server with "
                                    "--tool-call-parser", param="tool_choice" if choice else "tools")
            parse_calls = False  # tools only shown to the model, as vLLM does without a parser
        return OutputRules(reasoning=self.reasoning_parser, tools=self.tool_parser if parse_calls else None,
                           allowed=allowed, parallel=req.parallel_tool_calls is not False)

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names:
            raise APIError(404, f"model {requested!r} does not exist; this server serves {self.model_names}",
                           param="model", code="model_not_found")
        return requested

    # ---- request -> engine requests -----------------------------------------------------------
    def _check_common(self, req: p._GenerationRequest) -> int:
        """Reject what the diffusion sampler cannot honour; -> n."""
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
        if req.repetition_penalty not in (None, 1.0):
            raise APIError(400, f"repetition_penalty is not supported (got {req.repetition_penalty}; allowed: 1)",
                           param="repetition_penalty")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        if req.stream_drafts and not req.stream:
            raise APIError(400, "stream_drafts needs stream: true", param="stream_drafts")
        return n

    def _engine_requests(self, req: p._GenerationRequest, prompts: list, lengths: list[list[int]], n: int,
                         max_tokens: int | None, logprobs: int | None, skip_special_tokens: bool = True,
                         prompt_logprobs: int | None = None, structured_outputs=None) -> list:
        """n engine requests per prompt, checked against the limits first, their parameters resolved
        once per prompt (for its length) and taken by the engine as they are. The choices of a prompt
        share its ResolvedParams but their seeds (and so its draft and stop lists); prompt-major.
        skip_special_tokens: the endpoint's default, under the request's own (vLLM's field)."""
        limits.check_token_lists(n, [len(ids) for ids in lengths], req.draft, req.stop_token_ids, self.limits.max_model_len)
        names = (*p.SAMPLER_EXTENSIONS, *p.VLLM_SAMPLING, *self.sampler_extensions)
        values = {k: getattr(req, k) for k in names if getattr(req, k) is not None}
        skip = skip_special_tokens if req.skip_special_tokens is None else req.skip_special_tokens
        try:
            params = SamplingParams.of(**values, max_tokens=max_tokens, seed=req.seed, stop=req.stop, logprobs=logprobs,
                                       min_tokens=req.min_tokens or 0, prompt_logprobs=prompt_logprobs,
                                       output_kind="delta" if req.stream else "final_only", skip_special_tokens=skip,
                                       structured_outputs=structured_outputs)
            resolved = [self.engine.resolve(params, _prompt_length(prompt)) for prompt in prompts]
        except ValueError as e:
            raise bad_value(e, REQUEST_FIELDS, _request_names(req)) from None
        self._check_cost(resolved, n)
        return [(prompt, params if n == 1 else self._with_seed(params, i))
                for prompt, params in zip(prompts, resolved) for i in range(n)]

    @staticmethod
    def _with_seed(params: ResolvedParams, choice: int) -> ResolvedParams:
        """Choice i of a request seeded s draws from s + i; a shallow copy shares the checked lists."""
        if params.seed is None:
            return params
        out = copy.copy(params)
        out.seed = params.seed + choice
        return out

    def _check_cost(self, resolved: list[ResolvedParams], n: int) -> None:
        """Refuse an API request that would hold the decoder longer than the limit allows. The choices
        of a prompt differ only in their seeds, so they cost the same."""
        cost = 0
        for params in resolved:
            # Lengths beyond the context are the engine's to refuse, with its own message.
            room = max(1, self.limits.max_model_len - params.prompt_len)
            cost += n * self.engine.cost(replace(params, max_tokens=min(params.max_tokens, room)))
        if cost > self.max_request_cost:
            raise APIError(400, f"this request asks for up to {cost} canvas positions of denoising (choices x canvases x "
                                f"max_denoising_steps x canvas length), more than this server's limit of "
                                f"{self.max_request_cost} per request: lower n, max_tokens or max_denoising_steps",
                           param="max_tokens", code="request_too_costly")

    def _prompt_text(self, prompt: str | list[int], ids: list[int]) -> str:
        """What echo returns of a prompt: its text, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=False)

    def _encode(self, text: str, request_id: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this checkpoint has no tokenizer: send the prompt as token ids", param="prompt")
        if not text:  # as an empty list of ids: the BOS token alone is no prompt
            raise APIError(400, "prompt is empty", param="prompt")
        self._check_chars(len(text), "prompt")
        ids = self.tokenizer.encode(text)
        self.tokenizer.warn_unknown(f"request {request_id}", text, ids)
        return ids

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{param} of {chars} characters cannot fit in max_model_len={self.limits.max_model_len} "
                                f"tokens (no token covers more than {self.tokenizer.max_token_chars} characters)",
                           param=param)

    def _completion_prompts(self, prompt: str | list, request_id: str) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt, request_id)]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        out = []
        for x in prompt:
            check_deadline()
            out.append(self._encode(x, request_id) if isinstance(x, str) else x)
        return out

    def _chat_prompt(self, messages: list[p.ChatMessage], request_id: str, add_generation_prompt: bool = True,
                     tools: list[p.Tool] | None = None, chat_template_kwargs: dict | None = None) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this checkpoint has no tokenizer, so it has no chat template", param="messages")
        rendered = [self._template_message(i, m) for i, m in enumerate(messages)]
        kwargs = {**self.default_template_kwargs, **self._template_kwargs(chat_template_kwargs or {})}
        tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        # Everything the template reads counts, before it, the arguments' decoding or the tokenizer run.
        limits.check_template_text(rendered, tools, kwargs, self.max_prompt_chars, self.limits.max_model_len,
                                   self.tokenizer.max_token_chars)
        _decode_arguments(rendered)
        try:
            ids = self.tokenizer.encode_chat(rendered, add_generation_prompt=add_generation_prompt, tools=tools,
                                             guard=check_deadline, max_chars=self.max_prompt_chars, **kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        contents = "".join(m["content"] for m in rendered if isinstance(m["content"], str))
        self.tokenizer.warn_unknown(f"request {request_id}", contents, ids)
        return ids

    # ---- images in chat messages (docs/images.md) -----------------------------------------------
    async def _chat_images(self, messages: list[p.ChatMessage], client: str) -> list:
        """The images of the messages' image_url parts, fetched, decoded and preprocessed off the
        event loop (media.py); a bad one is a 400 naming it."""
        if not any(isinstance(m.content, list) and any(part.type in IMAGE_PART_TYPES for part in m.content) for m in messages):
            return []
        return await self.images.load([m.model_dump(exclude_none=True) for m in messages], client)

    def _with_images(self, ids: list[int], images: list) -> tuple[list[int] | PromptImages, list[list[int]]]:
        """-> (the engine's prompt: with images, their placeholders expanded, here and only here; the
        prompt ids that usage counts)."""
        if not images:
            return ids, [ids]
        try:
            expanded = self.engine.images.expand(ids, images)
        except ImageError as e:
            raise APIError(400, str(e), param="messages", code="invalid_image") from None
        return expanded, [expanded.token_ids]

    def _template_message(self, i: int, m: p.ChatMessage) -> dict:
        """A message as the chat template reads it: content parts as `template_content` renders them
        (the arguments of its tool calls are still JSON text; `_decode_arguments` decodes them)."""
        message = m.model_dump(exclude_none=True)
        if isinstance(message.get("content"), list):
            try:
                message["content"] = template_content(i, message["content"])
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        message.setdefault("content", "")
        return message

    def _template_kwargs(self, kwargs: dict) -> dict:
        """chat_template_kwargs, each a variable the template reads and the server does not set."""
        reserved = sorted(_SERVER_TEMPLATE_VARIABLES & kwargs.keys())
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them",
                           param="chat_template_kwargs")
        unread = sorted(kwargs.keys() - self.tokenizer.template_variables)
        if unread:
            raise APIError(400, f"chat_template_kwargs: this model's chat template does not read {', '.join(unread)}"
                                f"; it reads {', '.join(sorted(self.tokenizer.template_variables - _SERVER_TEMPLATE_VARIABLES)) or 'nothing else'}",
                           param="chat_template_kwargs")
        return kwargs

    # ---- engine outputs -> responses ----------------------------------------------------------
    async def add(self, requests: list, client: str) -> tuple[RequestStream, Callable[[], None]]:
        """Queue one API call's engine requests against `client`'s share (held until `release()`,
        which the response calls however it ends); a new structured output's automaton is built off
        the event loop first, within the engine's time bound. -> (their stream, release). Raises what
        the engine raises (ValueError for bad parameters), with the share released."""
        release = self.clients.hold(client, len(requests))
        try:
            for spec in structured_specs(requests):
                await self.engine.prepare(spec)
            return await self.engine.add(requests, client), release
        except BaseException:
            release()
            raise

    async def _respond(self, req, prompts: list[list[int]], requests, fmt: _Format, raw: Request) -> Response:
        try:
            stream, release = await self.add(requests, client_of(raw))
        except ValueError as e:
            raise bad_value(e, REQUEST_FIELDS, _request_names(req)) from None
        states = [ChoiceState() for _ in requests]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

            def close() -> None:
                stream.abort()
                release()

            stream.max_unread = self.max_stream_buffer
            return _EventStream(self._events(stream, states, prompts, fmt, include_usage, continuous), stream, close)
        try:
            finals = await self._collect(stream, raw)
        finally:
            release()
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        pieces = {i: states[i].advance(out) for i, out in finals.items()}
        body = fmt.response(pieces, usage(prompts, finals, len(states)))
        return Response(body.model_dump_json(), media_type="application/json")

    async def _events(self, stream: RequestStream, states: list[ChoiceState], prompts, fmt: _Format,
                      include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
        """continuous: usage so far in every chunk (vLLM's continuous_usage_stats)."""
        try:
            latest: dict[int, RequestOutput] = {}  # each choice's latest output: its usage so far
            for chunk in fmt.begin(len(states)):
                if continuous:
                    chunk.usage = usage(prompts, latest, len(states))
                yield _sse(chunk)
            finals = {}
            async for index, out in stream:
                if states[index].is_draft(out):
                    yield _sse(self._draft(fmt, index, out), event="draft")
                    continue
                chunk = fmt.chunk(index, states[index].advance(out))
                if continuous:
                    latest[index] = out
                    chunk.usage = usage(prompts, latest, len(states))
                yield _sse(chunk)
                if out.finished:
                    finals[index] = out
            if include_usage:
                yield _sse(fmt.usage_chunk(usage(prompts, finals, len(states))))
        except APIError as e:  # the output broke a rule of the request (tool_choice)
            yield _sse(error_body(e.status, e.message, e.param, e.code))
        except EngineUnavailable as e:
            yield _sse(error_body(503, str(e), code="engine_unavailable"))
        except RequestFailed as e:
            yield _sse(error_body(500, str(e), code="request_failed"))
        yield "data: [DONE]\n\n"

    def _draft(self, fmt: _Format, index: int, out: RequestOutput) -> p.DraftEvent:
        ids = out.draft_token_ids or []
        choice = p.DraftChoice(index=index, canvas=out.metrics["canvases"], denoising_steps=out.metrics["denoising_steps"],
                               token_ids=ids, text=None if self.tokenizer is None else self.tokenizer.decode(ids))
        if out.draft_entropy is not None:
            choice.tokens = [self.token_text(t) for t in ids]
            choice.entropy, choice.accepted = out.draft_entropy, out.draft_accepted
        return p.DraftEvent(id=fmt.id, object=fmt.draft_object, created=fmt.created, model=fmt.model, choices=[choice])

    async def _collect(self, stream: RequestStream, raw: Request) -> dict[int, RequestOutput] | None:
        """-> the final output of every request, or None if the client disconnected first."""

        async def gather() -> dict[int, RequestOutput]:
            return {index: out async for index, out in stream if out.finished}

        task = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            return task.result() if task.done() else None
        finally:
            task.cancel()
            gone.cancel()
            stream.abort()

    # ---- logprobs in OpenAI's two spellings ---------------------------------------------------
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int, top: bool) -> p.CompletionLogprobs:
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return p.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp.logprob for lp in lps],
            top_logprobs=[{self.token_text(t): v for t, v in lp.top.items()} for lp in lps] if top else None,
            text_offset=offsets,
        )

    def chat_logprobs(self, lps: list[TokenLogprob]) -> p.ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return p.ChatLogprobs(content=[
            p.ChatTokenLogprob(**entry(lp.token_id, lp.logprob), top_logprobs=[p.TopLogprob(**entry(t, v)) for t, v in lp.top.items()])
            for lp in lps
        ])
