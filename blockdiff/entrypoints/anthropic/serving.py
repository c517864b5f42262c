"""`POST /v1/messages` and `/v1/messages/count_tokens`: a Messages request runs as the chat request
it is (convert.py), through the chat endpoint's steps: the same chat template, sampler fields,
limits, images and output parsers (chat_output.py). The parsed output becomes content blocks: the
thinking a `thinking` block, the text a `text` block, each call a `tool_use` block; streamed, each
block is started, filled by deltas as canvases commit, and stopped, in Anthropic's event sequence.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from blockdiff.engine.async_engine import EngineUnavailable, RequestFailed, RequestStream
from blockdiff.entrypoints.anthropic import protocol as a
from blockdiff.entrypoints.anthropic.convert import chat_request, messages_names, stop_reason
from blockdiff.entrypoints.anthropic.errors import error_body
from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai.chat_output import OutputRules
from blockdiff.entrypoints.openai.clients import client_of
from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.serving import ChoiceState, ClientGone, OutputEvents, sse, usage
from blockdiff.entrypoints.openai.serving_chat import OpenAIServingChat
from blockdiff.entrypoints.openai.tool_parsers import ToolCall
from blockdiff.outputs import RequestOutput


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Blocks(OutputEvents):
    """The content blocks of one message (OutputEvents), in Anthropic's event sequence."""

    thinking, text = a.ThinkingOut, a.TextOut

    def __init__(self, rules: OutputRules):
        super().__init__(rules)
        self.content: list[a.TextOut | a.ThinkingOut | a.ToolUseOut] = []

    @property
    def called(self) -> bool:
        return any(isinstance(block, a.ToolUseOut) for block in self.content)

    def finish(self) -> list[dict]:
        return self._close()

    def _text(self, kind: type[a.TextOut] | type[a.ThinkingOut], text: str) -> list[dict]:
        events = []
        if not isinstance(self._open, kind):
            events += self._close()
            self._open = kind()
            self.content.append(self._open)
            events.append(self._event("content_block_start", content_block=kind().model_dump()))
        field = "text" if kind is a.TextOut else "thinking"
        setattr(self._open, field, getattr(self._open, field) + text)
        return events + [self._event("content_block_delta", delta={"type": f"{field}_delta", field: text})]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [self._event("content_block_stop")]

    def _call(self, call: ToolCall) -> list[dict]:
        """A call arrives whole: its block is started (with no input yet, as Anthropic's are), given
        its input as JSON in one delta, and stopped."""
        block = a.ToolUseOut(id=_id("toolu"), name=call.name, input=call.arguments)
        self.content.append(block)
        return [self._event("content_block_start", content_block={**block.model_dump(), "input": {}}),
                self._event("content_block_delta", delta={"type": "input_json_delta", "partial_json": call.arguments_json}),
                self._event("content_block_stop")]

    def _event(self, kind: str, **fields) -> dict:
        """An event about the last block."""
        return {"type": kind, "index": len(self.content) - 1, **fields}


def _sse(event: dict) -> str:
    return sse(event, event=event["type"])


class AnthropicServingMessages:
    def __init__(self, serving: OpenAIServingChat, chat_type: type[p.ChatCompletionRequest]):
        """`chat_type`: the server's chat body (protocol.request_types), which the requests become."""
        self.serving = serving
        self.chat_type = chat_type

    async def create(self, req: a.MessagesRequest, raw: Request) -> Response:
        model = self.serving.model_name(req.model)
        message_id = _id("msg")
        try:
            chat = await self._chat(req, raw)
            rules, prompts, stream, release = await self.serving.start(
                chat, message_id, raw, messages_names(), {"prompt": "messages", "stop": "stop_sequences"})
        except ClientGone:
            return Response(status_code=499)
        blocks = _Blocks(rules)
        if req.stream:
            return self.serving.event_stream(stream, release, self._events(stream, blocks, message_id, model, prompts))
        finals = await self.serving.collect(stream, raw, release)
        if finals is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        out = finals[0]
        blocks.feed(ChoiceState().advance(out))
        blocks.finish()
        return Response(self._message(message_id, model, blocks, prompts, out).model_dump_json(),
                        media_type="application/json")

    async def count_tokens(self, req: a.CountTokensRequest, raw: Request) -> a.CountTokensResponse:
        """The prompt tokens that the same conversation gets as a message request (images expanded)."""
        self.serving.model_name(req.model)
        chat = await self._chat(req, raw)
        client = client_of(raw)
        pre = self.serving.preprocess
        with messages_names():
            self.serving.output_rules(chat)  # the tools and tool_choice a message request would refuse
            images = await pre.chat_images(chat.messages, client)
            _, prompts = await pre.pool.run(client, pre.chat_prompt, chat, images, _id("count"))
        return a.CountTokensResponse(input_tokens=len(prompts[0]))

    async def _chat(self, req: a.CountTokensRequest, raw: Request) -> p.ChatCompletionRequest:
        """The chat request `req` is, made in the pool (off the event loop), as /v1/responses makes its own."""
        pre = self.serving.preprocess
        return await pre.pool.run(client_of(raw), chat_request, req, self.chat_type, pre.sampler_extensions)

    @staticmethod
    def _message(message_id: str, model: str, blocks: _Blocks, prompts: list[list[int]],
                 out: RequestOutput) -> a.MessageResponse:
        u = usage(prompts, {0: out}, 1)
        reason, sequence = stop_reason(out, blocks.called)
        return a.MessageResponse(id=message_id, content=blocks.content, model=model, stop_reason=reason,
                                 stop_sequence=sequence,
                                 usage=a.Usage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens))

    async def _events(self, stream: RequestStream, blocks: _Blocks, message_id: str, model: str,
                      prompts: list[list[int]]) -> AsyncIterator[str]:
        begun = a.MessageResponse(id=message_id, content=[], model=model,
                                  usage=a.Usage(input_tokens=sum(map(len, prompts)), output_tokens=0))
        yield _sse({"type": "message_start", "message": begun.model_dump()})
        yield _sse({"type": "ping"})
        try:
            async for events, out in blocks.follow(stream):
                for event in events:
                    yield _sse(event)
                if out.finished:
                    for event in blocks.finish():
                        yield _sse(event)
                    done = self._message(message_id, model, blocks, prompts, out)
                    yield _sse({"type": "message_delta", "usage": done.usage.model_dump(),
                                "delta": {"stop_reason": done.stop_reason, "stop_sequence": done.stop_sequence}})
                    yield _sse({"type": "message_stop"})
        except APIError as e:  # the output broke a rule of the request (tool_choice)
            yield _sse(error_body(e.status, e.message))
        except EngineUnavailable as e:
            yield _sse(error_body(503, str(e)))
        except RequestFailed as e:
            yield _sse(error_body(500, str(e)))
