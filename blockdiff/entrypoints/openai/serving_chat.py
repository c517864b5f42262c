"""`/v1/chat/completions`: messages rendered by the chat template, images in their content, tools
and a tool_choice, thinking; each choice's output read by the reasoning and tool-call parsers
(chat_output.py), delta by delta, and logprobs in the chat API's spelling. /v1/responses
(responses.py) runs its requests through the same steps."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai import reasoning, tool_parsers
from blockdiff.entrypoints.openai.chat_output import ChatOutput, OutputRules
from blockdiff.entrypoints.openai.clients import ClientLimit, client_of
from blockdiff.entrypoints.openai.errors import APIError, bad_value
from blockdiff.entrypoints.openai.request_builder import REQUEST_FIELDS, RequestBuilder, check_common
from blockdiff.entrypoints.openai.serving import OpenAIServing, Piece, ResponseFormat
from blockdiff.engine.async_engine import RequestStream
from blockdiff.engine.client import EngineClient
from blockdiff.outputs import TokenLogprob, vllm_logprobs
from blockdiff.sampling_params import MAX_LOGPROBS

class ChatFormat(ResponseFormat):
    draft_object = "chat.completion.draft"

    def __init__(self, serving, request_id, model, return_token_ids, logprobs: bool, rules: OutputRules,
                 echo: str | None = None, tokens_as_ids: bool = False, prompt_logprobs: bool = False):
        super().__init__(serving, request_id, model, return_token_ids, tokens_as_ids)
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's: the prompt's scores at the response's top level
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
        return self._chat_logprobs(piece.logprobs or []) if self.logprobs else None

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> p.ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return p.ChatLogprobs(content=[
            p.ChatTokenLogprob(**entry(lp.token_id, lp.logprob), top_logprobs=[p.TopLogprob(**entry(t, v)) for t, v in lp.top.items()])
            for lp in lps
        ])

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
        scores = self._prompt_scores(pieces[min(pieces)].prompt_logprobs) if self.prompt_logprobs and pieces else None
        return p.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=u,
                                        prompt_logprobs=scores)

    def _prompt_scores(self, scores: list[TokenLogprob] | None) -> list[dict[int, p.PromptLogprob] | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then each token's {id: Logprob}
        (itself and its alternatives, ranked), the texts as the response's logprobs spell them.
        Every choice shares the one prompt, so its scores are the first choice's."""
        return [None, *({t: p.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=self.token_text(t))
                         for t, lp in entry.items()} for entry in vllm_logprobs(scores or []))]


class OpenAIServingChat(OpenAIServing):
    """POST /v1/chat/completions, and the chat steps that /v1/responses runs."""

    def __init__(self, engine: EngineClient, served_model_names: list[str], preprocess: RequestBuilder,
                 clients: ClientLimit, max_stream_buffer: int, tool_call_parser: str | None,
                 reasoning_parser: str | None):
        super().__init__(engine, served_model_names, preprocess, clients, max_stream_buffer)
        self.tool_parser = self._parser("tool-call", tool_call_parser, tool_parsers.tool_call_parser,
                                        tool_parsers.Gemma4ToolParser)
        self.reasoning_parser = self._parser("reasoning", reasoning_parser, reasoning.reasoning_parser,
                                             reasoning.Gemma4ReasoningParser)

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

    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        n = check_common(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        prompt_logprobs = self.prompt_logprobs(req)
        rules = self.output_rules(req)
        request_id = p.new_id("chatcmpl", req.request_id)
        client = client_of(raw)
        images = await self.preprocess.chat_images(req.messages, client)
        prompts, requests = await self.preprocess.pool.run(client, self.preprocess.chat_requests, req, client, images, n, max_tokens,
                                                           logprobs, rules, request_id, prompt_logprobs)
        last = req.messages[-1]
        echo = last.content if req.echo and last.role == "assistant" and isinstance(last.content, str) else None
        fmt = ChatFormat(self, request_id, model, bool(req.return_token_ids), bool(req.logprobs), rules, echo,
                         bool(req.return_tokens_as_token_ids), prompt_logprobs is not None)
        return await self.respond(req, prompts, requests, fmt, raw)

    async def start(self, req: p.ChatCompletionRequest, request_id: str, raw: Request, renamed: AbstractContextManager,
                    value_names: dict[str, str]) -> tuple[OutputRules, list[list[int]], RequestStream, Callable[[], None]]:
        """A one-choice chat request through this endpoint's steps (its preprocessing in the server's
        pool, its engine request held against the client's share), up to the stream of its engine
        request and the release of that share: what /v1/responses and /v1/messages run, for a request
        of theirs that became `req`. Its errors name that API's fields: `renamed` (errors.renamed_params)
        renames the chat machinery's, `value_names` the engine's for bad parameters. Raises APIError
        and ClientGone."""
        client = client_of(raw)
        try:
            with renamed:
                rules = self.output_rules(req)
                images = await self.preprocess.chat_images(req.messages, client)
                prompts, requests = await self.preprocess.pool.run(client, self.preprocess.chat_requests, req, client, images, 1,
                                                                   req.max_tokens, None, rules, request_id)
                stream, release = await self.add(requests, raw)  # the share is held until the response ends
        except ValueError as e:
            raise bad_value(e, REQUEST_FIELDS, value_names) from None
        return rules, prompts, stream, release

    @staticmethod
    def prompt_logprobs(req: p.ChatCompletionRequest) -> int | None:
        """vLLM's prompt_logprobs: the alternatives each prompt token is scored with; as vLLM, not
        with a stream (0 there scores nothing)."""
        k = req.prompt_logprobs
        if k is None:
            return None
        if not 0 <= k <= MAX_LOGPROBS:
            raise APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", param="prompt_logprobs")
        if req.stream:
            if k > 0:
                raise APIError(400, "prompt_logprobs are not available with stream: true", param="prompt_logprobs")
            return None
        return k

    def output_rules(self, req: p.ChatCompletionRequest) -> OutputRules:
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
        # Parsed output is decoded with its special tokens (the parsers read the format's markers);
        # what is left as text drops them unless the request asks to keep them, as vLLM's default does.
        keep = req.skip_special_tokens is False or self.tokenizer is None
        return OutputRules(reasoning=self.reasoning_parser, tools=self.tool_parser if parse_calls else None,
                           allowed=allowed, parallel=req.parallel_tool_calls is not False,
                           special=None if keep else self.tokenizer.special_tokens)
