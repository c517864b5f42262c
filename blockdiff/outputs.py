"""What a request returns. With SamplingParams.output_kind "cumulative" (the default) each output
holds everything so far; "delta" holds what is new since the last output of the request (the
server streams these); "final_only" reports once, at the end."""

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
    finish_reason: str | None  # "stop", "length", "abort" or "error"; None while running
    finished: bool
    metrics: dict
    logprobs: list[TokenLogprob] | None = None
    draft_token_ids: list[int] | None = None  # latest argmax canvas, when drafts are streamed
    # With draft_details: that step's entropy per position (nats, of the temperature-scaled
    # distribution) and whether it kept the sampled token there (False: renoised for the next step).
    draft_entropy: list[float] | None = None
    draft_accepted: list[bool] | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache

    def to_dict(self) -> dict:
        return asdict(self)
