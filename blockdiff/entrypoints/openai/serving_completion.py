"""`/v1/completions`: a prompt, or several, each as text or token ids, with n choices each; echo
of the prompt (scored with logprobs), and logprobs in the completions API's spelling."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai import vllm_fields
from blockdiff.entrypoints.openai.clients import client_of
from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.request_builder import check_choices, check_common
from blockdiff.entrypoints.openai.response_size import CompletionSize
from blockdiff.entrypoints.openai.serving import OpenAIServing, Piece, ResponseFormat, json_body
from blockdiff.entrypoints.openai.structured import request_constraint
from blockdiff.outputs import TokenLogprob

class CompletionFormat(ResponseFormat):
    draft_object = "text_completion.draft"

    def __init__(self, serving, request_id, model, return_token_ids, logprobs: int | None,
                 echo: list[tuple[str, list[int]]] | None = None, n: int = 1, tokens_as_ids: bool = False):
        super().__init__(serving, request_id, model, return_token_ids, tokens_as_ids)
        self.logprobs = logprobs
        self.echo, self.n = echo, n  # echo: each prompt's text and ids, which its choices start with
        # text_offset runs over the token strings sent so far, per choice; it is not the text sent,
        # which lags behind the tokens while a stop string may still cut it.
        self._offsets: dict[int, int] = {}
        # Each prompt's part of its choices' logprobs, built once: the first of its choices to arrive
        # with the prompt's scores brings them (with score_once, the only one that has them).
        self._heads: dict[int, p.CompletionLogprobs] = {}

    def _parts(self, index: int, piece: Piece) -> tuple[p.CompletionChoice, p.CompletionLogprobs | None]:
        """A choice, its logprobs those of its tokens only; and, in its first piece with echo and
        logprobs, the prompt's part of its logprobs, which they follow (text offsets count it)."""
        first = index not in self._offsets
        offset = self._offsets.setdefault(index, 0)
        echo = self.echo[index // self.n] if self.echo is not None and first else None  # in a choice's first piece
        text = piece.text if echo is None else echo[0] + piece.text
        lp = head = None
        if self.logprobs is not None:
            top = self.logprobs > 0
            head = None if echo is None else self._head(index // self.n, echo[1], piece.prompt_logprobs, top)
            start = offset + (0 if head is None else sum(map(len, head.tokens)))
            lp = self._logprobs(piece.logprobs or [], start, top)
            self._offsets[index] = start + sum(map(len, lp.tokens))
        choice = p.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=piece.finish_reason,
                                    token_ids=self._ids(piece))
        return choice, head

    def _choice(self, index: int, piece: Piece) -> p.CompletionChoice:
        choice, head = self._parts(index, piece)
        if head is not None:
            choice.logprobs = vllm_fields.joined(head, choice.logprobs)
        return choice

    def _head(self, prompt: int, ids: list[int], scores: list[TokenLogprob] | None, top: bool) -> p.CompletionLogprobs:
        head = self._heads.get(prompt)
        if head is None:
            head = vllm_fields.echo_logprobs(ids, scores, self.token_text, top)
            if scores is not None:
                self._heads[prompt] = head
        return head

    def _logprobs(self, lps: list[TokenLogprob], offset: int, top: bool) -> p.CompletionLogprobs:
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

    def chunk(self, index: int, piece: Piece) -> BaseModel:
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[self._choice(index, piece)])

    def usage_chunk(self, u: p.Usage) -> BaseModel:
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=u)

    def response(self, pieces: dict[int, Piece], u: p.Usage) -> BaseModel:
        choices = [self._choice(i, pieces[i]) for i in sorted(pieces)]
        return p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)

    def body(self, pieces: dict[int, Piece], u: p.Usage) -> list[bytes]:
        """The response's JSON, each prompt's part of its choices' logprobs written once and copied
        into each of them: n choices echoing a long scored prompt hold it n times."""
        written, heads = [], {}
        for i in sorted(pieces):
            choice, head = self._parts(i, pieces[i])
            text = choice.model_dump_json()
            if head is not None:
                if id(head) not in heads:
                    heads[id(head)] = vllm_fields.written(head)
                text = vllm_fields.spliced(text, heads[id(head)])
            written.append(text.encode())
        return json_body(p.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=u),
                         {"choices": written})


def _prompt_list(prompt: str | list) -> list:
    """A completion request's prompts, each a string or token ids."""
    return [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)


def _prompt_count(prompt: str | list) -> int:
    """Prompts in a completion request's `prompt`, counted before any is tokenized."""
    return len(_prompt_list(prompt))


class OpenAIServingCompletion(OpenAIServing):
    """POST /v1/completions."""

    async def completions(self, req: p.CompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        n = check_common(req)
        vllm_fields.completion_max_tokens(req)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, n):
            raise APIError(400, f"best_of must equal n ({n}): candidates are not ranked", param="best_of")
        check_choices(_prompt_count(req.prompt), n)
        request_id = p.new_id("cmpl", req.request_id)
        client = client_of(raw)
        prompts, requests, echo = await self.preprocess.pool.run(client, self._completion_requests, req, client, n,
                                                                 request_id)
        fmt = CompletionFormat(self, request_id, model, bool(req.return_token_ids), req.logprobs, echo, n,
                               bool(req.return_tokens_as_token_ids))
        return await self.respond(req, prompts, requests, fmt, raw)

    def _completion_requests(self, req: p.CompletionRequest, client: str, n: int, request_id: str):
        """(In the pool) -> (the prompts' ids, `client`'s engine requests, with echo each prompt's text and ids)."""
        constraint = request_constraint(req)
        pre = self.preprocess
        prompts = pre.truncated(pre.completion_prompts(req.prompt, request_id, req.add_special_tokens is not False),
                                req.truncate_prompt_tokens)
        # A stream sends each choice's echo in its first chunk, which cannot wait for another choice's
        # scores: there every choice scores the prompt.
        requests = pre.engine_requests(req, client, prompts, prompts, n, req.max_tokens, req.logprobs,
                                       CompletionSize(bool(req.echo)), prompt_logprobs=vllm_fields.prompt_logprobs(req),
                                       structured_outputs=constraint, score_once=not req.stream)
        echo = [(pre.prompt_text(x, ids), ids) for x, ids in zip(_prompt_list(req.prompt), prompts)] if req.echo else None
        return prompts, requests, echo
