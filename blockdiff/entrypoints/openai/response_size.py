"""What a generation response could take, priced before any work (--max-response-bytes): each token
it returns as its endpoint's serializer spells it (its text, and with logprobs its entry and every
alternative's), the prompt's scores as often as the response repeats them. Token texts count as
the tokenizer's average entry; every number at its longest. An estimate that a response of ordinary
text stays under, by a margin that is mostly the numbers' room (tests/server/test_large_responses.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from blockdiff.sampling_params import ResolvedParams

FLOAT = 23  # a logprob at its longest: -1.2345678901234567e-05
OFFSET = 7  # a text offset and its comma
TOKEN_ID = 8  # a token id as a JSON key, quoted, and its colon
TOKEN_ID_TEXT = len("token_id:999999")  # a token spelled by its id (no tokenizer, return_tokens_as_token_ids)
ENVELOPE = 384  # a response's id, model and usage
COMPLETION_CHOICE, CHAT_CHOICE = 96, 192  # a choice's index, finish reason and empty fields

# Priced: (one prompt's resolved parameters, its choices, bytes of a token's text) -> bytes.
Pricing = Callable[[ResolvedParams, int, float], float]


@dataclass(frozen=True)
class CompletionSize:
    """/v1/completions: each choice's text (with echo, the prompt's first), and with logprobs, per
    token `tokens` ("text",), `token_logprobs`, `text_offset` and, with logprobs > 0, `top_logprobs`
    ({"text":logprob, ...}); echo with logprobs gives every choice the prompt's tokens so, each with
    the token itself among its alternatives."""

    echo: bool

    def __call__(self, params: ResolvedParams, n: int, text: float) -> float:
        k = params.logprobs
        prompt = params.prompt_len if self.echo else 0
        if k is None:
            return n * (COMPLETION_CHOICE + (prompt + params.max_tokens) * text)
        entry = 2 * text + 3 + FLOAT + 1 + OFFSET  # its text, and its "text", logprob and offset in the lists
        alternative = text + 3 + FLOAT + 1  # "text":logprob,
        top = 0 if k == 0 else len("{},")
        scored = prompt * text
        if params.prompt_logprobs is not None:
            scored = prompt * (entry + (0 if k == 0 else top + (k + 1) * alternative))
        return n * (COMPLETION_CHOICE + scored + params.max_tokens * (entry + top + k * alternative))


def chat_size(params: ResolvedParams, n: int, text: float) -> float:
    """/v1/chat/completions (and what runs as a chat): each choice's content, and with logprobs per
    token {"token", "logprob", "bytes": [each byte, up to 4 characters], "top_logprobs": [each
    alternative so]}; with prompt_logprobs, once for the response, per prompt token {"id": {"logprob",
    "rank", "decoded_token"}} for itself and each alternative."""
    k = params.logprobs
    entry = len('{"token":"","logprob":,"bytes":[]},') + text + FLOAT + 4 * text
    per_token = text if k is None else text + entry + len(',"top_logprobs":[]') + k * entry
    scores = 0
    if params.prompt_logprobs is not None:
        alternative = TOKEN_ID + len('{"logprob":,"rank":,"decoded_token":""},') + FLOAT + OFFSET + text
        scores = params.prompt_len * (2 + (params.prompt_logprobs + 1) * alternative)
    return n * (CHAT_CHOICE + params.max_tokens * per_token) + scores
