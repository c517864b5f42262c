"""`/v1/responses`, OpenAI's Responses API, on the chat endpoint's machinery.

A request's input items (with the conversation of `previous_response_id` before them) become chat
messages, its function tools the chat template's tools and its `reasoning` the template's thinking
switch; from there it is a chat request: the same template rendering, sampler fields, limits and
output parsers (chat_output.py) as /v1/chat/completions. The parsed output becomes output items:
the thinking a `reasoning` item, the text a `message`, each call a `function_call`; streamed, each
item is announced, filled by deltas as canvases commit, and closed, in OpenAI's event sequence.
Responses are stored in memory (`store`, OpenAI's default) for `previous_response_id` and
GET/DELETE /v1/responses/{id}.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response
from pydantic import TypeAdapter, ValidationError

from blockdiff.engine.async_engine import EngineUnavailable, RequestFailed, RequestStream
from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai import responses_protocol as r
from blockdiff.entrypoints.openai.body import MAX_JSON_VALUES, Budget, decode_json
from blockdiff.entrypoints.openai.chat_output import OutputRules
from blockdiff.entrypoints.openai.clients import client_of
from blockdiff.entrypoints.openai.errors import APIError, renamed_params
from blockdiff.entrypoints.openai.serving import ChoiceState, ClientGone, OutputEvents, Piece, sse, usage
from blockdiff.entrypoints.openai.serving_chat import OpenAIServingChat
from blockdiff.entrypoints.openai.tool_parsers import ToolCall
from blockdiff.outputs import RequestOutput

# How long a response stays stored: a day (OpenAI keeps them 30 days; this store is memory).
STORE_TTL_S = 24 * 3600.0
# The chat request's names of the fields whose errors a Responses request knows by other names.
_RESPONSES_NAMES = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
                    "response_format": "text.format"}
# `include` values that need nothing: reasoning is returned as plain text, never encrypted.
_HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})
_ITEMS = TypeAdapter(r.InputItem)
# Fields a Responses request passes to its chat request as they are (beside the sampler extensions).
_CHAT_FIELDS = ("stream", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "parallel_tool_calls", "user")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _responses_names():
    """Errors of the chat machinery, about fields under their chat names, under the Responses names."""
    return renamed_params(_RESPONSES_NAMES)


@dataclass
class _Stored:
    response: r.ResponseObject
    items: list  # its own turn: the request's input items and the response's output items
    previous: str | None  # the response it continued: the conversation is the chain of turns
    owner: str  # the client that made it, the only one that may read, continue or delete it
    size: int
    expires: float  # time.monotonic()


class ResponseStore:
    """Responses kept in memory for STORE_TTL_S, the oldest evicted first once their turns hold more
    than `max_bytes` of JSON. Each keeps only its own turn and the id of the response it continued,
    so a chain of turns counts each turn once (a conversation is read back along the chain), and a
    client sees only its own responses. Called from the preprocessing pool's threads and the loop."""

    def __init__(self, max_bytes: int, ttl: float = STORE_TTL_S):
        self.max_bytes, self.ttl = max_bytes, ttl
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: r.ResponseObject, items: list, previous: str | None, owner: str) -> bool:
        """Keep `response` (serialized here to size it: call it off the loop); False if it alone is
        larger than the store."""
        size = len(response.model_dump_json()) + sum(len(item.model_dump_json()) for item in items)
        if size > self.max_bytes:
            return False
        with self._lock:
            self._entries[response.id] = _Stored(response, items, previous, owner, size, time.monotonic() + self.ttl)
            self._bytes += size
            now = time.monotonic()
            while self._entries:
                oldest = next(iter(self._entries.values()))
                if self._bytes <= self.max_bytes and oldest.expires > now:
                    break
                self._drop(oldest.response.id)
        return True

    def get(self, response_id: str, owner: str) -> _Stored | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None and stored.expires <= time.monotonic():
                self._drop(response_id)
                return None
            return stored if stored is not None and stored.owner == owner else None

    def conversation(self, response_id: str, owner: str) -> list | None:
        """Every turn's items up to and including `response_id`'s, oldest first; None when it, or a
        response before it in its chain, is no longer stored."""
        turns = []
        while response_id is not None:
            stored = self.get(response_id, owner)
            if stored is None:
                return None
            turns.append(stored.items)
            response_id = stored.previous
        return [item for turn in reversed(turns) for item in turn]

    def delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is None or stored.owner != owner:
                return False
            self._drop(response_id)
            return True

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._entries.pop(response_id).size


def chat_messages(items: list, instructions: str | None) -> list[dict]:
    """Input items as chat messages: `instructions` a system message first; the output items of one
    assistant turn (reasoning, message, function calls in a row) one assistant message, with the
    thinking as `reasoning_content` and the calls as `tool_calls`; a call's output a tool message."""
    messages = [] if instructions is None else [{"role": "system", "content": instructions}]
    budget = Budget(max_items=MAX_JSON_VALUES)  # all the calls' arguments, as the chat path bounds them
    turn: dict | None = None
    for i, item in enumerate(items):
        if isinstance(item, r.FunctionCallOutputItem):
            turn = None
            output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            continue
        if isinstance(item, r.MessageItem) and item.role != "assistant":
            turn = None
            messages.append({"role": item.role, "content": _content(i, item.content)})
            continue
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        if isinstance(item, r.MessageItem):
            turn["content"] += _assistant_text(i, item.content)
        elif isinstance(item, r.ReasoningItem):
            thought = "".join(part.text for part in item.content or ())
            if thought:
                turn["reasoning_content"] = turn.get("reasoning_content", "") + thought
        else:
            try:  # bounded as the body is (a 400, not a RecursionError, for "[" * 100000)
                decode_json(item.arguments, f"input[{i}].arguments", budget)
            except json.JSONDecodeError as e:
                raise APIError(400, f"input[{i}].arguments is not JSON: {e}", param="input") from None
            except APIError as e:
                raise APIError(400, e.message, param="input") from None
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    return messages


def _content(i: int, content: str | list) -> str | list[dict]:
    """A user, system or developer message's content as the chat endpoint's content parts."""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, r.InputImage):
            if part.image_url is None:
                raise APIError(400, f"input[{i}].content[{j}]: an image by file_id needs OpenAI's Files API, which this "
                                    "server does not have; send it as image_url (a data: URL)", param="input")
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            parts.append({"type": "text", "text": part.refusal if isinstance(part, r.Refusal) else part.text})
    return parts


def _assistant_text(i: int, content: str | list) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if isinstance(part, r.InputImage):
            raise APIError(400, f"input[{i}].content[{j}]: an assistant message holds text only", param="input")
    return "".join(part.refusal if isinstance(part, r.Refusal) else part.text for part in content)


class _Output(OutputEvents):
    """The output items of one response (OutputEvents). An empty response still gets its (empty)
    message."""

    thinking, text = r.OutputReasoning, r.OutputMessage

    def __init__(self, rules: OutputRules, reasoning_markers: tuple[int | None, int | None]):
        super().__init__(rules)
        self._markers = reasoning_markers
        self.items: list[r.OutputItem] = []
        self._token_ids: list[int] = []

    def feed(self, piece: Piece) -> list[dict]:
        self._token_ids += piece.token_ids
        return super().feed(piece)

    def finish(self, status: str) -> list[dict]:
        """Close the last item; a response with neither text nor calls still gets its (empty) message."""
        events = []
        if not any(isinstance(item, (r.OutputMessage, r.OutputFunctionCall)) for item in self.items):
            events += self._text(r.OutputMessage, self._blank)
        return events + self._close(status)

    def reasoning_tokens(self) -> int:
        """Output tokens from a thinking channel's start marker to its end marker, both counted."""
        start, end = self._markers
        count, inside = 0, False
        for token in self._token_ids:
            inside = inside or token == start
            count += inside
            inside = inside and token != end
        return count

    def _text(self, kind: type, text: str) -> list[dict]:
        events = []
        if not isinstance(self._open, kind):
            events += self._close()
            item = kind(id=_id("msg" if kind is r.OutputMessage else "rs"))
            self.items.append(item)
            events.append(self._event("response.output_item.added", item=item.model_dump()))
            part = r.OutputTextPart() if kind is r.OutputMessage else r.ReasoningTextPart()
            item.content.append(part)
            events.append(self._event("response.content_part.added", item_id=item.id, content_index=0,
                                      part=part.model_dump()))
            self._open = item
        if text:
            part = self._open.content[0]
            part.text += text
            extra = {"logprobs": []} if kind is r.OutputMessage else {}
            events.append(self._event(f"response.{part.type}.delta", item_id=self._open.id, content_index=0,
                                      delta=text, **extra))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        """Events that end the open item (the last one), if any."""
        item = self._open
        if item is None:
            return []
        self._open = None
        item.status = status
        part = item.content[0]
        extra = {"logprobs": []} if isinstance(item, r.OutputMessage) else {}
        return [self._event(f"response.{part.type}.done", item_id=item.id, content_index=0, text=part.text, **extra),
                self._event("response.content_part.done", item_id=item.id, content_index=0, part=part.model_dump()),
                self._event("response.output_item.done", item=item.model_dump())]

    def _call(self, call: ToolCall) -> list[dict]:
        """A call arrives whole: its item is added, given its arguments in one delta, and done."""
        item = r.OutputFunctionCall(id=_id("fc"), call_id=_id("call"), name=call.name)
        self.items.append(item)
        added = self._event("response.output_item.added", item=item.model_dump())
        item.arguments, item.status = call.arguments_json, "completed"
        return [added,
                self._event("response.function_call_arguments.delta", item_id=item.id, delta=item.arguments),
                self._event("response.function_call_arguments.done", item_id=item.id, arguments=item.arguments),
                self._event("response.output_item.done", item=item.model_dump())]

    def _event(self, kind: str, **fields) -> dict:
        """An event about the last item."""
        return {"type": kind, "output_index": len(self.items) - 1, **fields}


def _status(out: RequestOutput) -> str:
    """A response ends "completed" (EOS, a stop string or token), or "incomplete" (out of tokens)."""
    return "completed" if out.finish_reason == "stop" else "incomplete"


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServingChat, chat_request: type[p.ChatCompletionRequest], store: ResponseStore):
        """`chat_request`: the server's chat body (protocol.request_types), which the requests become."""
        self.serving = serving
        self.chat_request = chat_request
        self.store = store
        tokenizer = serving.tokenizer
        parser = serving.reasoning_parser
        self._reasoning_markers = ((tokenizer.token_to_id(parser.start), tokenizer.token_to_id(parser.end))
                                   if parser is not None else (None, None))

    # ---- endpoints ----------------------------------------------------------------------------
    async def create(self, req: r.ResponsesRequest, raw: Request) -> Response:
        model = self.serving.model_name(req.model)
        _refuse_unsupported(req)
        given = [r.MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input or []
        if not given and req.previous_response_id is None:
            raise APIError(400, "input is empty: send input (text or items), or previous_response_id", param="input")
        client = client_of(raw)
        conversation = self._earlier(req.previous_response_id, client) + given
        response_id = _id("resp")
        # The conversation as a chat request (its call arguments decoded) in the pool, off the loop.
        chat = await self.serving.preprocess.pool.run(client, self._chat, req, conversation)
        try:
            rules, prompts, stream, release = await self.serving.start(chat, response_id, raw, _responses_names(), {
                "prompt": "input", "max_tokens": "max_output_tokens", "structured_outputs": "text.format"})
        except ClientGone:
            return Response(status_code=499)
        output = _Output(rules, self._reasoning_markers)
        begun = self._response(req, response_id, model, "in_progress")

        async def finish(out: RequestOutput) -> r.ResponseObject:
            response = begun.model_copy(update=dict(
                status=_status(out), completed_at=p.now(), output=output.items,
                usage=self._usage(prompts, out, output),
                incomplete_details=r.IncompleteDetails(reason="max_output_tokens") if out.finish_reason == "length" else None))
            if response.store:
                turn = given + [_ITEMS.validate_python(item.model_dump()) for item in output.items]
                await self.serving.preprocess.pool.run(client, self.store.put, response, turn, req.previous_response_id,
                                                       client)
            return response

        if req.stream:
            return self.serving.event_stream(stream, release, self._events(stream, output, begun, finish))
        finals = await self.serving.collect(stream, raw, release)
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        out = finals[0]
        output.feed(ChoiceState().advance(out))
        output.finish(_status(out))
        return Response((await finish(out)).model_dump_json(), media_type="application/json")

    def retrieve(self, response_id: str, client: str) -> r.ResponseObject:
        stored = self.store.get(response_id, client)
        if stored is None:
            raise _not_stored(response_id, "response_id")
        return stored.response

    def delete(self, response_id: str, client: str) -> r.DeletedResponse:
        if not self.store.delete(response_id, client):
            raise _not_stored(response_id, "response_id")
        return r.DeletedResponse(id=response_id)

    # ---- request -> engine request ------------------------------------------------------------
    def _earlier(self, previous_response_id: str | None, client: str) -> list:
        if previous_response_id is None:
            return []
        conversation = self.store.conversation(previous_response_id, client)
        if conversation is None:
            raise _not_stored(previous_response_id, "previous_response_id")
        return conversation

    def _chat(self, req: r.ResponsesRequest, conversation: list) -> p.ChatCompletionRequest:
        """The chat request this request is: its conversation as messages, its tools, and its sampler fields."""
        messages = chat_messages(conversation, req.instructions)
        if len(messages) > p.MAX_MESSAGES:
            raise APIError(400, f"the conversation has {len(messages)} messages, more than the {p.MAX_MESSAGES} "
                                "one request may hold", param="input")
        shared = (*_CHAT_FIELDS, *r.EXTENSIONS, *self.serving.preprocess.sampler_extensions)
        body = {name: getattr(req, name) for name in shared if getattr(req, name) is not None}
        body["messages"] = messages
        if req.max_output_tokens is not None:
            body["max_tokens"] = req.max_output_tokens
        if req.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in req.tools]
        if isinstance(req.tool_choice, r.FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        elif req.tool_choice is not None:
            body["tool_choice"] = req.tool_choice
        response_format = _response_format(req.text)
        if response_format is not None:
            body["response_format"] = response_format
        thinking = self._thinking(req.reasoning)
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        try:
            return self.chat_request.model_validate(body)
        except ValidationError as e:  # the items were valid; what they add up to may not be
            error = e.errors(include_url=False)[0]
            where = ".".join(str(x) for x in error["loc"])
            raise APIError(400, f"input, as chat messages: {where}: {error['msg']}", param="input") from None

    def _thinking(self, reasoning: r.ReasoningConfig | None) -> bool | None:
        """`reasoning.effort` as the chat template's thinking switch: "none" off, any other effort on,
        unset the template's default."""
        effort = None if reasoning is None else reasoning.effort
        if effort is None:
            return None
        tokenizer = self.serving.tokenizer
        if tokenizer is not None and "enable_thinking" in tokenizer.template_variables:
            return effort != "none"
        if effort == "none":
            return None  # the model cannot think anyway
        raise APIError(400, f"reasoning.effort {effort!r}: this model's chat template has no thinking switch (it does "
                            "not read enable_thinking), so thinking cannot be turned on", param="reasoning")

    # ---- outputs -> response ------------------------------------------------------------------
    def _response(self, req: r.ResponsesRequest, response_id: str, model: str, status: str) -> r.ResponseObject:
        return r.ResponseObject(
            id=response_id, created_at=p.now(), status=status, model=model, instructions=req.instructions,
            previous_response_id=req.previous_response_id, max_output_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, tools=req.tools or [], tool_choice=req.tool_choice or "auto",
            parallel_tool_calls=req.parallel_tool_calls is not False, reasoning=req.reasoning,
            text=req.text or r.TextConfig(format=r.TextFormat(type="text")), store=req.store is not False,
            metadata=req.metadata or {}, user=req.user)

    @staticmethod
    def _usage(prompts: list[list[int]], out: RequestOutput, output: _Output) -> r.ResponseUsage:
        u = usage(prompts, {0: out}, 1)
        return r.ResponseUsage(
            input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
            input_tokens_details=r.InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
            output_tokens_details=r.OutputTokensDetails(reasoning_tokens=output.reasoning_tokens()),
            diffusion=u.diffusion)

    async def _events(self, stream: RequestStream, output: _Output, begun: r.ResponseObject, finish) -> AsyncIterator[str]:
        sequence = itertools.count()

        def send(event: dict) -> str:
            return sse({**event, "sequence_number": next(sequence)}, event=event["type"])

        yield send({"type": "response.created", "response": begun.model_dump()})
        yield send({"type": "response.in_progress", "response": begun.model_dump()})
        try:
            async for events, out in output.follow(stream):
                for event in events:
                    yield send(event)
                if out.finished:
                    status = _status(out)
                    for event in output.finish(status):
                        yield send(event)
                    yield send({"type": f"response.{status}", "response": (await finish(out)).model_dump()})
        except APIError as e:  # the output broke a rule of the request (tool_choice)
            yield send({"type": "error", "code": e.code, "message": e.message, "param": e.param})
        except EngineUnavailable as e:
            yield send({"type": "error", "code": "engine_unavailable", "message": str(e), "param": None})
        except RequestFailed as e:
            yield send({"type": "error", "code": "request_failed", "message": str(e), "param": None})


def _not_stored(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response has id {response_id!r} (or one before it in its conversation): "
                         "responses made with store: false are not kept, each client sees only its own, they expire "
                         "after a day, and the oldest are dropped once the store is full", param=param,
                    code="response_not_found")


def _response_format(text: r.TextConfig | None) -> dict | None:
    """`text.format` as the chat endpoint's response_format (structured output: docs/structured_outputs.md);
    None for plain text. The Responses API spells a JSON schema flat: {type, name, schema, strict}."""
    if text is None or text.format is None or text.format.type == "text":
        return None
    if text.format.type == "json_object":
        return {"type": "json_object"}
    extra = text.format.model_extra or {}
    return {"type": "json_schema", "json_schema": {k: extra[k] for k in ("name", "description", "schema", "strict") if k in extra}}


def _refuse_unsupported(req: r.ResponsesRequest) -> None:
    """400s for what the server cannot do, each naming its field."""
    hosted = next((i for i, tool in enumerate(req.tools or ()) if isinstance(tool, r.HostedTool)), None)
    if hosted is not None:
        raise APIError(400, f"tools[{hosted}]: {req.tools[hosted].type!r} is one of OpenAI's hosted tools, which this "
                            "server does not have; it serves function tools ({'type': 'function', 'name': ...})",
                       param="tools")
    if req.background:
        raise APIError(400, "background responses are not supported: send the request and wait for it (or stream it)",
                       param="background")
    if req.conversation is not None:
        raise APIError(400, "conversation (OpenAI's Conversations API) is not supported: continue a stored response with "
                            "previous_response_id, or send the whole conversation as input", param="conversation")
    if req.prompt is not None:
        raise APIError(400, "prompt (OpenAI's stored prompt templates) is not supported: send instructions and input",
                       param="prompt")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise APIError(400, f"text.verbosity {req.text.verbosity!r} is not supported (the model has no verbosity "
                            "control); leave it unset", param="text.verbosity")
    if req.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported: an input longer than max_model_len is refused "
                            "(truncation 'disabled', the default)", param="truncation")
    if req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or ()):
        raise APIError(400, "logprobs are not served on /v1/responses; /v1/chat/completions returns them",
                       param="top_logprobs" if req.top_logprobs is not None else "include")
    unknown = [value for value in req.include or () if value not in _HARMLESS_INCLUDES | {"message.output_text.logprobs"}]
    if unknown:
        raise APIError(400, f"include {unknown[0]!r} is not supported: it is about OpenAI's hosted tools or files; "
                            f"supported: {', '.join(sorted(_HARMLESS_INCLUDES))}", param="include")
