"""draft_details: with each draft, the step's entropy per position and the positions it accepted.
They come back from the workers only for steps in which some request asks, and they are the numbers
the sampler decided with: the entropy-bound rule applied to the reported entropies gives the
reported accepted positions, on the eager path and on the static step alike."""

from __future__ import annotations

import pytest
import torch
from helpers import step_until_done

from blockdiff import LLM, SamplingParams
from blockdiff.diffusion.entropy_bound import entropy_bound_accept
from blockdiff.worker.canvas_step import canvas_step

CANVAS = 8  # the tiny checkpoint's canvas length
# Warm enough that the tiny model leaves positions to renoise, so that both outcomes are seen.
WARM = dict(t_min=1.0, t_max=2.0, entropy_bound=0.5, max_denoising_steps=6, max_tokens=16)


def _run(llm: LLM, requests: dict[str, SamplingParams]) -> tuple[dict[str, list], list]:
    """Step the engine until every request ends; -> the outputs of each request, and for every step
    whether its plan asked for details and what the executor returned."""
    engine = llm.engine
    steps = []
    execute = engine.executor.execute

    def recording(plan):
        out = execute(plan)
        steps.append((plan.draft_details, out))
        return out

    engine.executor.execute = recording
    try:
        outputs = step_until_done(engine, list(range(3, 15)), requests)
    finally:
        engine.executor.execute = execute
    return outputs, steps


def _check_details(outputs: list, bound: float) -> tuple[int, int]:
    """Every draft's details follow the entropy bound; -> (accepted, renoised) positions seen."""
    accepted = renoised = 0
    drafts = [o for o in outputs if not o.finished and o.draft_entropy is not None]
    assert drafts, "no draft carried details"
    for o in drafts:
        assert len(o.draft_entropy) == len(o.draft_accepted) == CANVAS
        assert all(e >= 0 for e in o.draft_entropy)
        rule = entropy_bound_accept(torch.tensor([o.draft_entropy]), torch.tensor([bound]))[0].tolist()
        assert o.draft_accepted == rule
        accepted += sum(o.draft_accepted)
        renoised += CANVAS - sum(o.draft_accepted)
    return accepted, renoised


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny) as llm:
        yield llm


def test_details_come_back_only_for_steps_that_ask(llm):
    outputs, steps = _run(llm, {
        "asks": SamplingParams(seed=1, stream_drafts=True, draft_details=True, output_kind="delta", **WARM),
        "drafts": SamplingParams(seed=2, stream_drafts=True, output_kind="delta", **{**WARM, "max_tokens": 32}),
    })
    accepted, renoised = _check_details(outputs["asks"], WARM["entropy_bound"])
    assert accepted and renoised
    # The other request's drafts carry none, though they ran in the same steps.
    assert all(o.draft_entropy is None and o.draft_accepted is None for o in outputs["drafts"])
    assert any(o.draft_token_ids for o in outputs["drafts"])
    asked = [out for details, out in steps if details]
    assert asked and all(out.entropy is not None and out.entropy.shape == out.accepted.shape == out.tokens.shape
                         for out in asked)
    # Once the asking request is gone, the longer one's steps return none.
    alone = [out for details, out in steps if not details and out is not None]
    assert alone and all(out.entropy is None and out.accepted is None for out in alone)


def test_no_request_asks_no_details(llm):
    outputs, steps = _run(llm, {"plain": SamplingParams(seed=3, stream_drafts=True, output_kind="delta", **WARM)})
    assert not any(details for details, _ in steps)
    assert all(out is None or out.entropy is None for _, out in steps)
    assert all(o.draft_entropy is None for o in outputs["plain"])


def test_static_step_reports_the_same_kind_of_details(tiny):
    """The static step (what --compile and CUDA graphs run) returns the details too; run here
    without compiling, as the function the compiler would trace."""
    with LLM(tiny, compile=True) as llm:
        steps = llm.engine.executor.runner.canvas_steps
        steps.fn = canvas_step
        outputs, _ = _run(llm, {"asks": SamplingParams(seed=4, stream_drafts=True, draft_details=True,
                                                       output_kind="delta", **WARM)})
        assert steps.shapes, "the static step did not run"
    accepted, renoised = _check_details(outputs["asks"], WARM["entropy_bound"])
    assert accepted and renoised


def test_details_need_drafts():
    with pytest.raises(ValueError, match="draft_details needs stream_drafts"):
        SamplingParams(draft_details=True)
    with pytest.raises(ValueError, match="draft_details must be a bool"):
        SamplingParams(stream_drafts=True, draft_details=1)
