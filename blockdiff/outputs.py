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
    # token id -> its text, for the token and its alternatives, where the engine has a tokenizer
    texts: dict[int, str] = field(default_factory=dict)


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank among the vocabulary (1: the most likely; None
    where unknown) and its text (None where the engine has no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def vllm_logprobs(lps: list[TokenLogprob]) -> list[dict[int, Logprob]]:
    """Per token, vLLM's {token id: Logprob} holding the token itself and its top alternatives."""
    out = []
    for lp in lps:
        ranks = {t: r for r, t in enumerate(lp.top, start=1)}
        entry = {lp.token_id: Logprob(lp.logprob, ranks.get(lp.token_id), lp.texts.get(lp.token_id))}
        entry.update({t: Logprob(v, ranks[t], lp.texts.get(t)) for t, v in lp.top.items() if t != lp.token_id})
        out.append(entry)
    return out


@dataclass
class CompletionOutput:
    """One completion of a request, in vLLM's shape (`RequestOutput.outputs[0]`)."""

    index: int
    text: str | None  # None when the checkpoint has no tokenizer
    token_ids: list[int]
    # The sum of the whole output's token logprobs; None unless logprobs were asked for (and, for
    # output_kind "delta", until the last output)
    cumulative_logprob: float | None
    token_logprobs: list[TokenLogprob] | None  # per token, its logprob and top alternatives
    finish_reason: str | None  # "stop", "length", "abort" or "error"; None while running
    # The stop string or stop token id (of stop_token_ids) that ended the output; None for EOS, length
    stop_reason: str | int | None = None

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """vLLM's per-token {token id: Logprob}, built from token_logprobs."""
        return None if self.token_logprobs is None else vllm_logprobs(self.token_logprobs)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request returns, in vLLM's shape: the prompt, and `outputs`, its one completion.
    `text`, `token_ids` and `finish_reason` read `outputs[0]`'s."""

    request_id: str
    prompt: str | None  # the prompt text (after a chat template, the rendered conversation)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict
    # With SamplingParams.prompt_logprobs: the scores of the prompt's tokens from the second on
    prompt_token_logprobs: list[TokenLogprob] | None = None
    draft_token_ids: list[int] | None = None  # latest argmax canvas, when drafts are streamed
    # With draft_details: that step's entropy per position (nats, of the temperature-scaled
    # distribution) and whether it kept the sampled token there (False: renoised for the next step).
    draft_entropy: list[float] | None = None
    draft_accepted: list[bool] | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's: per prompt token, {token id: Logprob}; None for the first, which nothing scores."""
        if self.prompt_token_logprobs is None:
            return None
        return [None, *vllm_logprobs(self.prompt_token_logprobs)]

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def to_dict(self) -> dict:
        return asdict(self)
