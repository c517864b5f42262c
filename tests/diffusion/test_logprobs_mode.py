"""Logprobs as vLLM reports them: `--logprobs-mode` raw_logprobs by default,
the model's own log-softmax before the temperature, so a greedy request's alternatives are real
log-probabilities; processed_logprobs the temperature-scaled distribution the sampler drew from
(what blockdiff reported before); the *_logits modes the logits themselves; and each Logprob's
decoded_token the token's text offline. Prompt logprobs are raw in every mode, as in vLLM."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Harness

from blockdiff import LLM, SamplingParams
from blockdiff.model.loader import load_model

PROMPT = [5, 6, 7, 8, 9]
CL = 8  # the tiny checkpoint's canvas length
DRAFT = [11, 40, 3, 250, 17, 90, 6, 121]


def _one_step(**extra) -> SamplingParams:
    """One canvas denoised in one step from the draft: its tokens are the argmax of the logits of
    the draft's first step (no self-conditioning), which the test computes again."""
    return SamplingParams(max_tokens=CL, max_denoising_steps=1, draft=DRAFT, ignore_eos=True, logprobs=5, seed=3,
                          **extra)


@pytest.fixture(scope="module")
def model_log_softmax(tiny) -> torch.Tensor:
    """[CL, vocab] log_softmax of the model's logits over the draft after the prompt: computed
    through the model directly, not through the engine's sampler."""
    harness = Harness(load_model(tiny))
    harness.encode(PROMPT)
    return torch.log_softmax(harness.decode(DRAFT)[:CL].float(), dim=-1)


@pytest.fixture(scope="module")
def outputs(tiny) -> dict[str, list]:
    """Per mode: the greedy one-step request's token logprobs, and a request at temperature 1
    (t_min = t_max = 1: the schedule's temperature is 1 at every step) of two canvases."""
    out = {}
    for mode in ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"):
        with LLM(tiny, logprobs_mode=mode) as llm:
            greedy, warm = llm.generate([PROMPT, PROMPT], [_one_step(temperature=0),
                                                           SamplingParams(max_tokens=16, t_min=1.0, t_max=1.0,
                                                                          ignore_eos=True, logprobs=4, seed=5,
                                                                          prompt_logprobs=2)], use_tqdm=False)
        out[mode] = [greedy.outputs[0], warm]
    return out


def test_greedy_logprobs_are_the_model_log_softmax(outputs, model_log_softmax):
    """At temperature 0 the token's and its alternatives' logprobs are torch.log_softmax of the
    model's logits at their position: finite, their probabilities add up to at most 1."""
    greedy = outputs["raw_logprobs"][0]
    assert greedy.token_ids == model_log_softmax.argmax(-1).tolist()
    for pos, lp in enumerate(greedy.token_logprobs):
        want = model_log_softmax[pos]
        assert abs(lp.logprob - want[lp.token_id].item()) < 1e-4
        assert list(lp.top) == want.topk(5).indices.tolist()
        for token, value in lp.top.items():
            assert value > -50 and abs(value - want[token].item()) < 1e-4
        assert sum(math.exp(v) for v in lp.top.values()) <= 1 + 1e-6


def test_processed_logprobs_are_the_temperature_scaled_ones(outputs):
    """processed_logprobs keeps what the sampler drew from: at temperature 0 (the schedule scaled
    by 1e-6) the committed token has logprob 0 and its alternatives fall to about -1e6 and below."""
    greedy = outputs["processed_logprobs"][0]
    assert greedy.token_ids == outputs["raw_logprobs"][0].token_ids
    for lp in greedy.token_logprobs:
        assert lp.logprob == 0.0
        assert all(v < -1e3 for t, v in lp.top.items() if t != lp.token_id)


def test_logits_modes_are_the_logits(outputs, model_log_softmax):
    """raw_logits: the logits themselves, so they differ from raw_logprobs by one constant per
    position (log Z); processed_logits: the logits over the temperature, the raw ones x 1/t."""
    raw, raw_logits = outputs["raw_logprobs"][0], outputs["raw_logits"][0]
    processed_logits = outputs["processed_logits"][0]
    for lp, logit, scaled in zip(raw.token_logprobs, raw_logits.token_logprobs, processed_logits.token_logprobs):
        shift = logit.logprob - lp.logprob
        assert shift > 0  # log Z of a distribution over 301 tokens, not 0
        for token, value in lp.top.items():
            assert abs(logit.top[token] - value - shift) < 1e-4
            assert scaled.top[token] / logit.top[token] > 1e5  # divided by the greedy schedule's ~1e-6


def test_raw_and_processed_agree_at_temperature_one(outputs):
    """Where the sampler's temperature is 1 the processed distribution is the raw one: the same
    tokens and the same logprobs, in two canvases."""
    raw, processed = outputs["raw_logprobs"][1], outputs["processed_logprobs"][1]
    assert raw.token_ids == processed.token_ids and raw.outputs[0].token_logprobs
    for a, b in zip(raw.outputs[0].token_logprobs, processed.outputs[0].token_logprobs):
        assert a.top.keys() == b.top.keys() and abs(a.logprob - b.logprob) < 1e-5
        assert all(abs(a.top[t] - b.top[t]) < 1e-5 for t in a.top)


def test_prompt_logprobs_are_raw_in_every_mode(outputs):
    """Prompt logprobs are the model's log-softmax whatever --logprobs-mode says, as in vLLM."""
    want = outputs["raw_logprobs"][1].prompt_token_logprobs
    assert want and all(lp.logprob <= 0 for lp in want)
    for mode in ("processed_logprobs", "raw_logits", "processed_logits"):
        assert [(lp.token_id, lp.logprob, lp.top) for lp in outputs[mode][1].prompt_token_logprobs] == \
            [(lp.token_id, lp.logprob, lp.top) for lp in want]


def test_decoded_token_is_the_token_text(tiny, outputs):
    """Offline, each Logprob's decoded_token is its token decoded alone, as the server shows it,
    for generated tokens, their alternatives and prompt tokens."""
    with LLM(tiny) as llm:
        tok = llm.get_tokenizer()
    warm = outputs["raw_logprobs"][1]
    entries = [e for per_token in warm.outputs[0].logprobs for e in per_token.items()]
    entries += [e for per_token in warm.prompt_logprobs[1:] for e in per_token.items()]
    assert len(entries) > 16
    for token, logprob in entries:
        assert logprob.decoded_token == tok.decode([token], skip_special_tokens=False)


def test_a_sampler_that_cannot_report_a_mode_refuses_it(tiny):
    """The confidence-threshold sampler's logprobs come from the step that committed each token,
    whose logits are gone by the canvas's end: it reports log-probabilities only."""
    with pytest.raises(Exception, match="reports raw_logprobs or processed_logprobs only"):
        LLM(tiny, diffusion_sampler="confidence_threshold", logprobs_mode="raw_logits")
    with pytest.raises(Exception, match="logprobs_mode"):
        LLM(tiny, logprobs_mode="raw")
