"""What a request returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None  # None when the checkpoint has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"; None while running
    finished: bool
    metrics: dict
    logprobs: list[TokenLogprob] | None = None
    draft_token_ids: list[int] | None = None  # latest argmax canvas, when drafts are streamed

    def to_dict(self) -> dict:
        return asdict(self)
