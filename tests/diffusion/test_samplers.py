"""The diffusion-sampler seam (blockdiff/diffusion/strategy.py) and its second strategy, the
confidence-threshold sampler: its step on its own, resolving a request's fields against the
model's sampler, and the whole engine with it (eager, the static canvas step, two ranks, the
demo model, the CLI's flags and the real server with the openai client)."""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest
import torch
from server_process import fixture_value, serve

from blockdiff import LLM, SamplingParams
from blockdiff.arg_utils import add_engine_args, add_sampling_args, engine_config, sampling_params
from blockdiff.diffusion.confidence_threshold import ConfidenceThreshold
from blockdiff.diffusion.entropy_bound import EntropyBound
from blockdiff.diffusion.registry import SAMPLERS
from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.entrypoints.openai.protocol import request_types
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard
from blockdiff.sampling_params import REFERENCE_DEFAULTS, InvalidParam
from blockdiff.worker.canvas_step import CanvasSteps

CT = ConfidenceThreshold()
CT_DEFAULTS = {f.name: f.default for f in CT.fields} | {"max_tokens": 16}
CL, V = 6, 11


def _logits(top: list[list[float]]) -> torch.Tensor:
    """[canvases, CL, V] logits whose most likely token at each position is token (position + 1) % V
    with probability `top[c][i]`, the rest spread evenly."""
    out = torch.empty(len(top), CL, V)
    for c, row in enumerate(top):
        for i, p in enumerate(row):
            probs = torch.full((V,), (1 - p) / (V - 1))
            probs[(i + 1) % V] = p
            out[c, i] = probs.log()
    return out


def _step(state, logits, steps, threshold, seed=0):
    slots = torch.arange(logits.shape[0])
    values = CT.canvas_values(CT.resolve(SamplingParams.of(threshold=threshold), CT_DEFAULTS))
    params = CT.step_params([steps] * len(slots), [values] * len(slots), [seed + i for i in range(len(slots))],
                            [0] * len(slots))
    vocab = VocabParallel(VocabShard.make(0, 1, V), TPGroup())
    res = CT.step(logits.clone(), state, slots, params, vocab)
    state.put(slots, res.updates)
    return res


def test_confidence_threshold_commits_what_reaches_the_threshold_and_keeps_it():
    state = CT.new_state(3, CL, 4, torch.float32, torch.device("cpu"))
    state.start(torch.arange(2), torch.zeros(2, CL, dtype=torch.long))
    argmax = torch.tensor([(i + 1) % V for i in range(CL)])
    # canvas 0: positions 1 and 4 are confident; canvas 1: none is, position 2 is the most likely
    res = _step(state, _logits([[0.5, 0.95, 0.3, 0.2, 0.99, 0.1], [0.3, 0.4, 0.6, 0.2, 0.1, 0.5]]), 5, 0.9)
    assert state.fixed[:2].tolist() == [[False, True, False, False, True, False], [False, False, True, False, False, False]]
    assert torch.equal(res.tokens, argmax.expand(2, CL)) and not res.finished.any()
    assert torch.equal(state.canvas[0, [1, 4]], argmax[[1, 4]])  # committed positions hold their token
    assert torch.allclose(state.logprob[0, [1, 4]], torch.tensor([0.95, 0.99]).log())
    # The next step's model would predict other tokens at the committed positions: they stay.
    shifted = torch.roll(_logits([[0.99] * CL, [0.3] * CL]), 1, dims=-1)
    res = _step(state, shifted, 4, 0.9)
    assert res.finished.tolist() == [True, False]  # canvas 0: everything committed
    assert res.tokens[0, [1, 4]].tolist() == argmax[[1, 4]].tolist()
    others = [0, 2, 3, 5]
    assert res.tokens[0, others].tolist() == ((argmax[others] + 1) % V).tolist()
    assert state.fixed[1].sum() == 2  # one more: the most likely open one
    # The last step (n = 1) ends every canvas: open positions take this step's argmax.
    open_ = ~state.fixed[1]
    res = _step(state, _logits([[0.5] * CL, [0.2] * CL]), 1, 0.9)
    assert res.finished.all() and open_.sum() == 4
    assert torch.equal(res.tokens[1][open_], argmax[open_])
    assert torch.allclose(res.logprob[1][open_], torch.tensor(0.2).log())


def test_fields_of_another_sampler_are_refused_and_defaults_filled():
    eb = EntropyBound()
    with pytest.raises(InvalidParam, match="entropy_bound is not a parameter of this model's sampler, confidence_threshold") as e:
        CT.resolve(SamplingParams(entropy_bound=0.2), CT_DEFAULTS)
    assert e.value.field == "entropy_bound"
    with pytest.raises(InvalidParam, match="threshold is not a parameter of this model's sampler, entropy_bound"):
        eb.resolve(SamplingParams.of(threshold=0.5), REFERENCE_DEFAULTS | {"max_tokens": 8})
    with pytest.raises(InvalidParam, match="^threshold must be a finite number > 0 and <= 1, got 1.5") as e:
        CT.resolve(SamplingParams.of(threshold=1.5), CT_DEFAULTS)
    assert e.value.field == "threshold"
    with pytest.raises(InvalidParam, match="temperature 0.7: the confidence_threshold sampler") as e:
        CT.resolve(SamplingParams(temperature=0.7), CT_DEFAULTS)
    with pytest.raises(InvalidParam, match="top_k is not a parameter"):
        CT.resolve(SamplingParams(top_k=5), CT_DEFAULTS)
    # vLLM's knobs at their neutral values, as clients send them, and greedy temperature pass
    got = CT.resolve(SamplingParams(top_p=1.0, top_k=-1, min_p=0.0, temperature=0), CT_DEFAULTS)
    assert got.extra_args == {"threshold": 0.95} and got.max_tokens == 16 and got.max_denoising_steps == 48
    with pytest.raises(InvalidParam, match="max_denoising_steps must be at most 20"):
        CT.resolve(SamplingParams(max_denoising_steps=21), CT_DEFAULTS, max_steps=20)


def test_every_sampler_builds_its_step_inputs_from_its_table():
    """Each registered sampler's table starts with the fields every sampler has; its step inputs
    carry every per-canvas field of its table in the field's dtype, with the resolved values."""
    for sampler in (cls() for cls in SAMPLERS.values()):
        assert [f.name for f in sampler.fields[:2]] == ["max_tokens", "max_denoising_steps"]
        defaults = {f.name: f.default for f in sampler.fields} | {"max_tokens": 8}
        params = sampler.resolve(SamplingParams(), defaults)
        step = sampler.step_params([3], [sampler.canvas_values(params)], [0], [0])
        for f in (f for f in sampler.fields if f.per_canvas):
            value = step.tensors()[f.name]
            want = 0 if f.name == "settle_steps" else f.default  # the exact mode's canvas never settles
            assert value.dtype == getattr(torch, f.dtype) and value.item() == pytest.approx(want), (sampler.name, f.name)


def _tokens(llm: LLM, prompts, **kw) -> list[list[int]]:
    params = SamplingParams.of(max_tokens=16, max_denoising_steps=8, seed=3, ignore_eos=True, **kw)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [[5, 9, 2], [7] * 11, [3, 4]]


@pytest.mark.slow  # three engines, one of two ranks: ~15 s on 2 cores
def test_confidence_threshold_runs_eager_static_and_on_two_ranks(tiny, single_threaded_workers):
    """One position per step at threshold 1 (no probability reaches it): a canvas of 8 takes its 8
    steps; at a tiny threshold every position commits at once. The static canvas step and two
    ranks give the eager tokens."""
    with LLM(tiny, diffusion_sampler="confidence_threshold") as llm:
        assert llm.engine.sampler.name == "confidence_threshold" and not hasattr(llm.engine.executor.runner.state, "soft")
        slow = llm.generate(PROMPTS[0], SamplingParams.of(max_tokens=16, max_denoising_steps=20, threshold=1.0,
                                                          ignore_eos=True), use_tqdm=False)[0]
        fast = llm.generate(PROMPTS[0], SamplingParams.of(max_tokens=16, threshold=1e-9, ignore_eos=True),
                            use_tqdm=False)[0]
        assert (slow.metrics["canvases"], slow.metrics["denoising_steps"]) == (2, 16)
        assert (fast.metrics["canvases"], fast.metrics["denoising_steps"]) == (2, 2)
        eager = _tokens(llm, PROMPTS, threshold=0.05)
        assert eager == _tokens(llm, PROMPTS, threshold=0.05)  # seeded: the same again
        r = llm.engine.executor.runner
        r.canvas_steps = CanvasSteps(r.model, r.sampler, r.vocab, r.kv, r.geometry, r.tables.tables, r.state, r.requests,
                                     r.device, False, False)
        assert _tokens(llm, PROMPTS, threshold=0.05) == eager
    with LLM(tiny, diffusion_sampler="confidence_threshold", tensor_parallel_size=2) as llm:
        assert _tokens(llm, PROMPTS, threshold=0.05) == eager


def test_confidence_threshold_on_the_demo_model():
    """The trained demo model, in chat: the sampler commits several positions per step."""
    with LLM(diffusion_sampler="confidence_threshold") as llm:
        out = llm.chat([{"role": "user", "content": "reverse: stone"}], SamplingParams.of(max_tokens=32, threshold=0.9),
                       use_tqdm=False)[0]
    assert out.text and out.metrics["denoising_steps"] < out.metrics["canvases"] * llm.engine.canvas_length


def test_sampler_flags_reach_the_engine(tiny):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_sampling_args(p)
    args = p.parse_args(["--model", tiny, "--diffusion-sampler", "confidence_threshold", "--threshold", "0.5"])
    cfg = engine_config(args)
    assert cfg.diffusion_sampler == "confidence_threshold"
    assert sampling_params(args).extra_args == {"threshold": 0.5}
    with pytest.raises(SystemExit):
        p.parse_args(["--diffusion-sampler", "nope"])
    with pytest.raises(ValueError, match="--threshold is not a flag of this model's sampler, entropy_bound"):
        LLM(tiny, sampling_defaults={"threshold": 0.5})


def test_request_bodies_take_the_fields_of_the_models_sampler():
    completion, chat = request_types(ConfidenceThreshold.fields)
    assert "threshold" in completion.model_fields and "entropy_bound" not in chat.model_fields
    completion, chat = request_types(EntropyBound.fields)
    assert "entropy_bound" in completion.model_fields and "threshold" not in chat.model_fields


ct_server = serve(fixture_value("tiny"), "--diffusion-sampler", "confidence_threshold", "--threshold", "0.2",
                  "--max-model-len", "64", "--served-model-name", "tiny")


def test_confidence_threshold_through_the_server(ct_server, tiny):
    client = openai.OpenAI(base_url=ct_server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    body = {"threshold": 0.05, "seed": 3, "ignore_eos": True, "max_denoising_steps": 8}
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, extra_body=body)
    with LLM(tiny, diffusion_sampler="confidence_threshold", sampling_defaults={"threshold": 0.2}) as llm:
        want = llm.generate(PROMPTS[0], SamplingParams.of(max_tokens=16, **body), use_tqdm=False)[0]
    assert got.choices[0].text == want.text and got.usage.diffusion["denoising_steps"] == want.metrics["denoising_steps"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert chat.choices[0].finish_reason in ("stop", "length")
    # The entropy-bound sampler's field is unknown here: ignored, and named in the log, as vLLM does
    client.completions.create(model="tiny", prompt="hi", max_tokens=8, extra_body={"entropy_bound": 0.2})
    assert "request fields ignored: entropy_bound (unknown)" in ct_server.log()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=8, extra_body={"threshold": 2.0})
    assert e.value.body["param"] == "threshold" and "threshold must be" in e.value.body["message"]
    schema = httpx.get(ct_server.url + "/openapi.json", timeout=10).json()["components"]["schemas"]
    assert "threshold" in schema["CompletionRequest"]["properties"]
    assert "entropy_bound" not in schema["CompletionRequest"]["properties"]
    # The defaults the playground fills its controls from are this sampler's fields (the server's flag over its own).
    defaults = client.models.list().data[0].model_extra["sampling_defaults"]
    assert defaults["threshold"] == 0.2 and "entropy_bound" not in defaults and "t_min" not in defaults
