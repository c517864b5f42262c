"""SamplingParams on its own (blockdiff/sampling_params.py): every field a bad value can reach is
refused when the parameters are made, with a ValueError naming the field; the neutral values vLLM's
tools send are accepted."""

from __future__ import annotations

import pytest

from blockdiff import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        # the engine's own fields
        ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_denoising_steps", 0),
        ("entropy_bound", 0.0), ("entropy_bound", -1.0), ("t_min", -0.1), ("t_max", 0.0),
        ("stability_threshold", -1), ("confidence_threshold", -0.1), ("seed", "x"), ("stop", [""]),
        ("stop_token_ids", [-1]), ("draft", ["a"]), ("logprobs", 21), ("ignore_eos", "yes"), ("max_tokens", True),
        # vLLM's penalties outside vLLM's bounds, OpenAI's logit_bias outside OpenAI's; out-of-range values
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", True), ("frequency_penalty", "1"),
        ("logit_bias", {5: 100.5}), ("logit_bias", {5: -101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0}),
        ("logit_bias", {i: 1.0 for i in range(301)}), ("logit_bias", [5]), ("min_tokens", -1),
        ("prompt_logprobs", 21),
        # the candidate draw's truncation (min-p, top-k, top-p)
        ("top_k", -2), ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5), ("top_p", True),
    ],
)
def test_invalid_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_vllms_neutral_penalties_are_accepted_and_min_tokens_is_bounded_by_max_tokens():
    SamplingParams(repetition_penalty=1.0, presence_penalty=0.0)  # the neutral values vLLM's tools send
    assert not SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0, logit_bias={}).penalized
    # vLLM's bounds, OpenAI's for logit_bias, are accepted
    assert SamplingParams(repetition_penalty=1e-3, presence_penalty=-2.0, frequency_penalty=2.0).penalized
    assert SamplingParams(logit_bias={i: (-100.0, 100)[i % 2] for i in range(300)}).penalized
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
