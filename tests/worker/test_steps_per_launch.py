"""Several denoising steps per launch: in the steady state the engine runs K steps
back to back through the static step (worker/canvas_step.py); a canvas that finishes inside them
keeps its state and results from the step it finished at, and the host reads the finished flags
once per launch. Outputs (tokens, logprobs, step counts) are the same for every K, with canvases
stopping early at different steps."""

from __future__ import annotations

import pytest

from blockdiff import LLM, SamplingParams
from blockdiff.config import EngineConfig

DEMO_PROMPTS = ["12+30=", "reverse: hello", "sort: 93172", "7+8=", "reverse: stone"]


def _run(llm: LLM, prompts, params) -> tuple[list, list[int]]:
    """-> (each output's tokens, logprobs and counts; the steps of each launch that ran canvases only)."""
    engine, launches = llm.engine, []
    execute = engine.executor.execute

    def watched(plan):
        if plan.denoise is not None and all(r.decoder for r in plan.rows):
            launches.append(plan.steps)
        return execute(plan)

    engine.executor.execute = watched
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.executor.execute = execute
    return [(o.token_ids, None if o.outputs[0].token_logprobs is None else [lp.logprob for lp in o.outputs[0].token_logprobs],
             o.metrics["canvases"], o.metrics["denoising_steps"]) for o in outs], launches


def test_every_k_gives_the_outputs_of_one_step_at_a_time_on_the_demo_model():
    """The trained demo model stops its canvases early, each at its own step: sampled and greedy
    requests, up to 16 steps a canvas. (No logprobs: a step that reports them runs alone, from its
    own distribution; the random model's test below has a request with them.)"""
    params = [SamplingParams(max_tokens=24, seed=i, **({"temperature": 0} if i == 3 else {}))
              for i in range(len(DEMO_PROMPTS))]
    runs = {}
    for k in (1, 3, 8):
        with LLM(num_scheduler_steps=k) as llm:
            runs[k] = _run(llm, DEMO_PROMPTS, params)
    one, launches = runs[1]
    assert set(launches) == {1}
    steps = [s for *_, s in one]
    assert len(set(steps)) > 1 and any(s % 16 for s in steps)  # canvases stopped early, at different steps
    for k in (3, 8):
        outputs, launches = runs[k]
        assert outputs == one, k
        assert k in launches and len(launches) < len(runs[1][1])


def test_every_k_gives_the_same_outputs_on_a_random_model(tiny):
    """Sampled at the default temperatures, where the last bit of a logit can change a token: a
    restricted draw, logprobs, a draft, canvases of 5 to 7 steps (not multiples of K)."""
    prompts = [[5, 6, 7], [9] * 13, [3, 4] * 4]
    params = [SamplingParams(max_tokens=20, max_denoising_steps=7, seed=1, ignore_eos=True, entropy_bound=0.8,
                             stability_threshold=1, confidence_threshold=6.0),
              SamplingParams(max_tokens=16, max_denoising_steps=5, seed=2, ignore_eos=True, top_k=9, logprobs=0),
              SamplingParams(max_tokens=24, max_denoising_steps=6, seed=3, ignore_eos=True, draft=[7] * 10)]
    runs = {}
    for k in (1, 4):
        with LLM(tiny, num_scheduler_steps=k) as llm:
            runs[k] = _run(llm, prompts, params)
    assert runs[4][0] == runs[1][0] and 4 in runs[4][1]


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_a_bad_number_of_steps_per_launch_is_refused(bad):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig("unused", num_scheduler_steps=bad)
