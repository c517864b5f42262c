"""What the generation endpoints (serving_completion.py, serving_chat.py, responses.py) share once a
request is built (request_builder.py): its engine requests added against its client's share,
and their outputs streamed as server-sent events (one chunk per committed canvas, drafts between)
or collected into one response, in the endpoint's format; usage and token texts."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pydantic_core
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from blockdiff.engine.async_engine import EngineUnavailable, RequestFailed, RequestStream
from blockdiff.engine.client import EngineClient, structured_specs
from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai.chat_output import ChatOutput, OutputRules
from blockdiff.entrypoints.openai.clients import ClientLimit, client_of
from blockdiff.entrypoints.openai.errors import APIError, bad_value, error_body
from blockdiff.entrypoints.openai.request_builder import REQUEST_FIELDS, RequestBuilder, request_names
from blockdiff.entrypoints.openai.tool_parsers import ToolCall
from blockdiff.inputs import EngineRequest
from blockdiff.outputs import RequestOutput, TokenLogprob

log = logging.getLogger(__name__)

@dataclass
class Piece:
    """What one chunk adds to a choice (or, from a fresh ChoiceState, the whole choice)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's scores (echo), in a choice's first piece


class OutputEvents:
    """A streamed message's parts (content blocks, output items), built from the parsed pieces of its
    output as they arrive; each `feed` returns the stream events it makes (a whole response drops
    them). A text or thinking part stays open while its text grows and is closed when another kind
    of output begins; blank text before an answer waits, so that blank space around calls makes no
    part. An API's subclass says how a part opens, grows and closes (`_text`, `_close`, `_call`) and
    which kinds are thinking and text."""

    thinking: type
    text: type

    def __init__(self, rules: OutputRules):
        self._parser = ChatOutput(rules)
        self._open = None
        self._blank = ""

    async def follow(self, stream: RequestStream) -> AsyncIterator[tuple[list[dict], RequestOutput]]:
        """Each output of the one request of `stream` that is not a draft, with the events it makes."""
        state = ChoiceState()
        async for _, out in stream:
            if not state.is_draft(out):
                yield self.feed(state.advance(out)), out

    def feed(self, piece: Piece) -> list[dict]:
        parsed = self._parser.feed(piece.text, piece.finish_reason is not None)
        events = self._text(self.thinking, parsed.reasoning) if parsed.reasoning else []
        if parsed.content:
            events += self._answer(parsed.content)
        for call in parsed.calls:
            events += self._close() + self._call(call)
        return events

    def _answer(self, text: str) -> list[dict]:
        if isinstance(self._open, self.text):
            return self._text(self.text, text)
        self._blank += text
        if not self._blank.strip():
            return []
        text, self._blank = self._blank, ""
        return self._text(self.text, text)

    def _text(self, kind: type, text: str) -> list[dict]:
        raise NotImplementedError

    def _close(self) -> list[dict]:
        raise NotImplementedError

    def _call(self, call: ToolCall) -> list[dict]:
        raise NotImplementedError


class ChoiceState:
    """What has been sent of one choice. The engine sends deltas (output_kind "delta"), with text
    that may still change held back (see engine/detokenizer.py)."""

    def __init__(self):
        self.canvases = 0

    def is_draft(self, out: RequestOutput) -> bool:
        """An output that only shows a canvas being denoised: no canvas ended, and no token came
        (the fast mode streams a canvas's settled prefix before it ends)."""
        return not out.finished and out.metrics["canvases"] == self.canvases and not out.token_ids

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


class ResponseFormat:
    """How one endpoint spells its chunks and responses (subclasses: chunk, usage_chunk, response)."""

    draft_object: str

    def __init__(self, serving: OpenAIServing, request_id: str, model: str, return_token_ids: bool,
                 tokens_as_ids: bool = False):
        self.serving, self.id, self.model, self.created = serving, request_id, model, p.now()
        self.return_token_ids = return_token_ids
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids
        self._texts: dict[int, str] = {}  # token_text's, once per token: logprobs name the same tokens again and again

    def token_text(self, token_id: int) -> str:
        """A token as logprobs spell it: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids,
        for tokens whose text is not valid UTF-8 alone)."""
        text = self._texts.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self.tokens_as_ids else self.serving.token_text(token_id)
            self._texts[token_id] = text
        return text

    def _ids(self, piece: Piece) -> list[int] | None:
        return piece.token_ids if self.return_token_ids else None

    def begin(self, count: int) -> list[BaseModel]:
        return []

    def body(self, pieces: dict[int, Piece], u: p.Usage) -> list[bytes]:
        """The whole response's JSON (the subclass's `response`), in json_body's parts."""
        return json_body(self.response(pieces, u))


def json_body(response: BaseModel, written: dict[str, list[bytes]] | None = None) -> list[bytes]:
    """`response.model_dump_json()` in parts that are sent one after the other (JSONParts), its
    top-level lists (choices, prompt_logprobs) written an item at a time: one call over a large
    body, or one join of its parts, holds the GIL, so the event loop and the engine's step thread,
    for as long as it takes to write or copy all of it (tenths of a second for tens of MB on a
    busy core). written: lists whose items the caller wrote already (the response holds them empty)."""
    lists = {name: [pydantic_core.to_json(item) for item in value] for name in type(response).model_fields
             if isinstance(value := getattr(response, name), list) and value}
    lists.update(written or {})
    envelope = response.model_copy(update={name: [] for name in lists}).model_dump_json()
    parts, at = [], 0
    for name in type(response).model_fields:
        if name in lists:
            marker = envelope.index(f'"{name}":[]', at) + len(f'"{name}":[')
            parts.append(envelope[at:marker].encode())
            parts += [item if i == 0 else b"," + item for i, item in enumerate(lists[name])]
            at = marker
    parts.append(envelope[at:].encode())
    return parts


class JSONParts(Response):
    """A JSON body sent a part at a time (json_body's), with its Content-Length."""

    media_type = "application/json"

    def __init__(self, parts: list[bytes]):
        self.parts = parts
        super().__init__(headers={"content-length": str(sum(map(len, parts)))})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, part in enumerate(self.parts, 1):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(self.parts)})


def sse(model: BaseModel | dict, event: str | None = None) -> str:
    data = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends (finished, client gone,
    cancelled before the first byte), and drops its connection once the client has left more of
    it unread than the stream's bound (`stream.overflowed`): a client that does not read would
    otherwise have the outputs queued for it until it hangs up."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream, self._on_close = stream, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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


class ClientGone(Exception):
    """The client disconnected before its requests were queued."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    """An endpoint's engine, preprocessing and served names, and its outputs' way back."""

    def __init__(self, engine: EngineClient, served_model_names: list[str], preprocess: RequestBuilder,
                 clients: ClientLimit, max_stream_buffer: int):
        """clients: counts each client's engine requests; max_stream_buffer: bytes a stream's client may
        leave unread."""
        self.engine = engine
        self.preprocess = preprocess
        self.clients = clients
        self.max_stream_buffer = max_stream_buffer
        self.limits = engine.limits
        self.tokenizer = engine.tokenizer
        self.model_names = served_model_names

    @property
    def adapters(self) -> dict:
        """The adapters served, by name (the preprocessor's, which names each request's adapter)."""
        return self.preprocess.adapters

    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names and requested not in self.adapters:
            # The adapters as served now: runtime loads and unloads change the dict.
            raise APIError(404, f"model {requested!r} does not exist; this server serves "
                                f"{[*self.model_names, *self.adapters]}",
                           param="model", code="model_not_found")
        return requested

    # ---- engine outputs -> responses ----------------------------------------------------------
    async def add(self, requests: list[EngineRequest], raw: Request) -> tuple[RequestStream, Callable[[], None]]:
        """Queue one API call's engine requests against their client's share (held until `release()`,
        which the response calls however it ends); a new structured output's automaton is built off
        the event loop first, within the engine's bounds, and given up if the client disconnects
        meanwhile (ClientGone). -> (their stream, release). Raises what the engine raises (ValueError
        for bad parameters), with the share released."""
        client = client_of(raw)
        release = self.clients.hold(client, len(requests))
        try:
            specs = structured_specs(requests)
            if specs:
                await self._prepare(specs, client, raw)
            return await self.engine.add(requests), release
        except BaseException:
            release()
            raise

    async def _prepare(self, specs: list, client: str, raw: Request) -> None:
        async def prepare_all() -> None:
            for spec in specs:
                await self.engine.prepare(spec, client)

        task = asyncio.ensure_future(prepare_all())
        gone = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise ClientGone
            task.result()
        finally:
            task.cancel()  # a build nobody else waits for is killed
            gone.cancel()

    async def respond(self, req, prompts: list[list[int]], requests, fmt: ResponseFormat, raw: Request) -> Response:
        try:
            stream, release = await self.add(requests, raw)
        except ClientGone:
            return Response(status_code=499)
        except ValueError as e:
            raise bad_value(e, REQUEST_FIELDS, request_names(req)) from None
        states = [ChoiceState() for _ in requests]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return self.event_stream(stream, release, self._events(stream, states, prompts, fmt, include_usage, continuous))
        finals = await self.collect(stream, raw, release)
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        pieces = {i: states[i].advance(out) for i, out in finals.items()}
        # Off the event loop, to its bytes: a large body (echo with logprobs: every choice a prompt's
        # tokens with their alternatives) takes seconds to build.
        u = usage(prompts, finals, len(states))
        return JSONParts(await asyncio.to_thread(fmt.body, pieces, u))

    async def _events(self, stream: RequestStream, states: list[ChoiceState], prompts, fmt: ResponseFormat,
                      include_usage: bool, continuous: bool = False) -> AsyncIterator[str]:
        """continuous: usage so far in every chunk (vLLM's continuous_usage_stats)."""
        try:
            latest: dict[int, RequestOutput] = {}  # each choice's latest output: its usage so far
            for chunk in fmt.begin(len(states)):
                if continuous:
                    chunk.usage = usage(prompts, latest, len(states))
                yield sse(chunk)
            finals = {}
            async for index, out in stream:
                if states[index].is_draft(out):
                    yield sse(self._draft(fmt, index, out), event="draft")
                    continue
                chunk = fmt.chunk(index, states[index].advance(out))
                if continuous:
                    latest[index] = out
                    chunk.usage = usage(prompts, latest, len(states))
                yield sse(chunk)
                if out.finished:
                    finals[index] = out
            if include_usage:
                yield sse(fmt.usage_chunk(usage(prompts, finals, len(states))))
        except APIError as e:  # the output broke a rule of the request (tool_choice)
            yield sse(error_body(e.status, e.message, e.param, e.code))
        except EngineUnavailable as e:
            yield sse(error_body(503, str(e), code="engine_unavailable"))
        except RequestFailed as e:
            yield sse(error_body(500, str(e), code="request_failed"))
        yield "data: [DONE]\n\n"

    def _draft(self, fmt: ResponseFormat, index: int, out: RequestOutput) -> p.DraftEvent:
        ids = out.draft_token_ids or []
        choice = p.DraftChoice(index=index, canvas=out.metrics["canvases"], denoising_steps=out.metrics["denoising_steps"],
                               token_ids=ids, text=None if self.tokenizer is None else self.tokenizer.decode(ids))
        if out.draft_entropy is not None:
            choice.tokens = [self.token_text(t) for t in ids]
            choice.entropy, choice.accepted = out.draft_entropy, out.draft_accepted
        return p.DraftEvent(id=fmt.id, object=fmt.draft_object, created=fmt.created, model=fmt.model, choices=[choice])

    def event_stream(self, stream: RequestStream, release: Callable[[], None], events: AsyncIterator[str]) -> EventStream:
        """A streamed response of `events`: when it ends or its client leaves, the engine requests are
        aborted and their hold on the client's count released."""
        def close() -> None:
            stream.abort()
            release()

        stream.max_unread = self.max_stream_buffer
        return EventStream(events, stream, close)

    async def collect(self, stream: RequestStream, raw: Request, release: Callable[[], None]) -> dict[int, RequestOutput] | None:
        """-> the final output of every request, or None if the client disconnected first; then the
        requests' hold on the client's count is released."""

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
            release()

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
