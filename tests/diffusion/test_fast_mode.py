"""The fast denoising mode (docs/architecture.md, "Fewer forwards"): a position whose argmax held
for settle_steps steps with its entropy under settle_entropy is settled; it is never renoised and
never changes, later steps run only the unsettled rows (over the settled rows' kept K/V), usage
counts the rows the model ran, the leftmost settled run streams before the canvas ends, and a
fast request batched with an exact one gives what it gives alone. Steps are recorded by wrapping
the real executor's `execute` and the real model's self-conditioning block (which every decoder
row the model runs goes through), as tests/diffusion/test_draft_details.py does."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import step_until_done

from blockdiff import LLM, SamplingParams
from blockdiff.diffusion.entropy_bound import EntropyBound
from blockdiff.model.attention import Row, build_metadata, keep_kv, run_active_rows
from blockdiff.model.interface import layer_kinds
from blockdiff.model.loader import load_model
from blockdiff.sampling_params import REFERENCE_DEFAULTS
from blockdiff.step import CacheConfig
from blockdiff.worker.kv_cache import allocate, geometry

CANVAS = 8  # the tiny checkpoint's canvas length
PROMPT = list(range(3, 15))
# Warm temperatures and a loose bound, so that positions settle at different steps on the tiny
# random model (its distributions are nearly flat) and canvases run several steps.
FAST = dict(t_min=0.1, t_max=0.2, max_denoising_steps=8, confidence_threshold=0.0, denoising_mode="fast",
            settle_steps=1, settle_entropy=100.0, max_tokens=24)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny) as llm:
        yield llm


def _run(llm: LLM, requests: dict[str, SamplingParams]) -> tuple[dict[str, list], list, list[int]]:
    """Step the engine until every request ends; -> each request's outputs, each step's (plan,
    output, the slots' input canvases after it), and the decoder rows the model ran in each forward."""
    engine = llm.engine
    runner = engine.executor.runner
    steps, rows = [], []
    execute = engine.executor.execute

    def recording(plan):
        out = execute(plan)
        slots = [r.slot for r in plan.rows if r.decoder]
        steps.append((plan, out, runner.state.canvas[slots].clone()))
        return out

    hook = runner.model.self_conditioning.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    engine.executor.execute = recording
    try:
        outputs = step_until_done(engine, PROMPT, requests)
    finally:
        engine.executor.execute = execute
        hook.remove()
    return outputs, steps, rows


def test_settled_positions_are_never_renoised_and_never_change(llm):
    outputs, steps, _ = _run(llm, {"fast": SamplingParams(seed=5, stream_drafts=True, **FAST)})
    settled_at, seen_partial = {}, False  # (canvas, position) -> the token it settled with
    canvas = 0
    for plan, out, inputs in steps:
        if out is None or out.settled is None:
            continue
        assert out.settled.shape == out.tokens.shape == (1, CANVAS)
        settled, tokens = out.settled[0], out.tokens[0]
        seen_partial |= bool(settled.any() and not settled.all())
        for p in range(CANVAS):
            if (canvas, p) in settled_at:
                assert settled[p] and tokens[p] == settled_at[(canvas, p)], "a settled position changed"
            elif settled[p]:
                settled_at[(canvas, p)] = int(tokens[p])
        # a settled position's next input is its token: it is not renoised
        assert torch.equal(inputs[0][settled], tokens[settled])
        if out.finished[0]:
            committed = outputs["fast"][-1].outputs[0].token_ids
            canvas += 1
    assert seen_partial, "no step left a canvas partly settled: the test proves nothing"
    # what the canvases committed holds every settled token
    final = outputs["fast"][-1].outputs[0].token_ids
    for (c, p), token in settled_at.items():
        if c * CANVAS + p < len(final):
            assert final[c * CANVAS + p] == token
    assert committed == final


def test_a_fast_step_runs_only_the_unsettled_rows_and_usage_counts_them(llm):
    outputs, steps, rows = _run(llm, {"fast": SamplingParams(seed=6, **FAST)})
    decoder_steps = [(plan, out) for plan, out, _ in steps if out is not None and len(out.finished)]
    assert len(rows) == len(decoder_steps)  # one decoder forward per step, one canvas in it
    before = torch.zeros(CANVAS, dtype=torch.bool)
    for (plan, out), ran in zip(decoder_steps, rows):
        if plan.new_canvas_rows:
            before = torch.zeros(CANVAS, dtype=torch.bool)
        assert ran == CANVAS - int(before.sum()) == out.rows_evaluated[0]
        before = out.settled[0]
    usage = outputs["fast"][-1].metrics
    assert usage["canvas_positions_evaluated"] == sum(rows)
    assert sum(rows) < usage["denoising_steps"] * CANVAS, "no step skipped a row"


def test_the_exact_mode_runs_every_row(llm):
    outputs, steps, rows = _run(llm, {"exact": SamplingParams(seed=6, **{**FAST, "denoising_mode": "exact"})})
    assert all(r == CANVAS for r in rows) and all(out.settled is None for _, out, _ in steps if out is not None)
    usage = outputs["exact"][-1].metrics
    assert usage["canvas_positions_evaluated"] == usage["denoising_steps"] * CANVAS == sum(rows)


def test_a_fast_and_an_exact_request_in_one_batch_each_give_what_they_give_alone(llm):
    fast = SamplingParams(seed=7, **FAST)
    exact = replace(fast, denoising_mode="exact", seed=8)
    alone = {name: _run(llm, {name: p})[0][name][-1].outputs[0].token_ids
             for name, p in (("fast", fast), ("exact", exact))}
    together, steps, _ = _run(llm, {"fast": fast, "exact": exact})
    assert any(out is not None and out.settled is not None and len(out.finished) == 2 for _, out, _ in steps)
    assert {name: outs[-1].outputs[0].token_ids for name, outs in together.items()} == alone


def test_the_settled_prefix_streams_before_the_canvas_ends_and_is_never_retracted(llm):
    params = SamplingParams(seed=10, output_kind="cumulative", **{**FAST, "max_tokens": 32})
    outputs, _, _ = _run(llm, {"fast": params})
    texts = [o.outputs[0].token_ids for o in outputs["fast"]]
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:])), "streamed tokens were taken back"
    # some output came while its canvas was still being denoised
    assert any(len(o.outputs[0].token_ids) % CANVAS and not o.finished for o in outputs["fast"])
    final = texts[-1]
    # the same request with its output reported once at the end, and as deltas, gives the same output
    once, _, _ = _run(llm, {"fast": replace(params, output_kind="final_only")})
    assert once["fast"][-1].outputs[0].token_ids == final
    deltas, _, _ = _run(llm, {"fast": replace(params, output_kind="delta")})
    assert [t for o in deltas["fast"] for t in o.outputs[0].token_ids] == final


def test_a_stop_string_across_the_streamed_prefix_ends_the_text_where_it_would_have(llm):
    params = SamplingParams(seed=10, output_kind="cumulative", **{**FAST, "max_tokens": 32})
    free, _, _ = _run(llm, {"fast": params})
    text = free["fast"][-1].outputs[0].text
    # a stop string across the end of the first prefix streamed before its canvas ended
    streamed = next(o.outputs[0].text for o in free["fast"] if len(o.outputs[0].token_ids) % CANVAS)
    assert 0 < len(streamed) < len(text)
    stop = text[len(streamed) - 1 : len(streamed) + 1]
    cut = text[: text.index(stop)]
    stopped, _, _ = _run(llm, {"fast": replace(params, stop=[stop])})
    texts = [o.outputs[0].text for o in stopped["fast"]]
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:])), "streamed text was taken back"
    assert texts[-1] == cut and stopped["fast"][-1].outputs[0].finish_reason == "stop"


def test_settled_positions_count_as_certain_for_the_exact_stop():
    """Half a canvas settled at entropy 0.2, the other half now sure of the argmax it repeats: the
    exact stop holds (argmax stable, mean entropy under confidence_threshold), since a settled
    position is final. Counted at the entropy it settled with, which no later step lowers, the mean
    would stay at 0.1 and the canvas would run on."""
    from blockdiff.diffusion.entropy_bound import denoise_params
    from blockdiff.diffusion.vocab_parallel import VocabParallel
    from blockdiff.parallel.group import TPGroup
    from blockdiff.parallel.vocab import VocabShard

    vocab, sampler = 37, EntropyBound()
    params = sampler.resolve(SamplingParams(denoising_mode="fast", settle_steps=3, settle_entropy=0.5,
                                            confidence_threshold=0.01, stability_threshold=1), REFERENCE_DEFAULTS)
    state = sampler.new_state(2, CANVAS, 4, torch.float32, "cpu")
    tokens = torch.arange(CANVAS) + 3
    state.last_argmax[0], state.run[0] = tokens, 1
    state.settled[0, : CANVAS // 2], state.kept_entropy[0, : CANVAS // 2] = True, 0.2
    logits = torch.full((1, CANVAS, vocab), -30.0)
    logits[0, torch.arange(CANVAS), tokens] = 30.0
    res = sampler.step(logits, state, torch.tensor([0]), denoise_params([8], [params], [1]),
                       VocabParallel(VocabShard.make(0, 1, vocab), TPGroup()))
    assert not res.updates["settled"][0, CANVAS // 2 :].any()  # the sure half has held 1 step of 3
    assert torch.equal(res.tokens[0], tokens) and bool(res.finished[0])


def test_bad_values_name_their_field():
    with pytest.raises(ValueError, match="^denoising_mode must be one of 'exact', 'fast', got 'quick'"):
        SamplingParams(denoising_mode="quick")
    with pytest.raises(ValueError, match="^settle_steps must be an integer >= 1"):
        SamplingParams(settle_steps=0)
    with pytest.raises(ValueError, match="^settle_entropy must be a finite number >= 0"):
        SamplingParams(settle_entropy=-1.0)


@torch.inference_mode()
def test_active_row_attention_on_triton_matches_the_reference(tiny):
    """A step that runs only some canvas positions, over the others' kept K/V, through the whole tiny
    model with each attention backend (Triton under its interpreter, tests/conftest.py): a prompt, a
    full canvas step that keeps every position's K/V, then a step of half the positions."""
    model = load_model(tiny)
    cache = CacheConfig(num_slots=2, num_blocks=32, block_size=4, max_model_len=64)
    blocks = tuple(range(20, 4, -1))
    running = np.array([[True, False, False, True, True, False, True, False]])
    canvas = [40, 41, 42, 43, 44, 45, 46, 47]
    logits = {}
    for backend in ("reference", "triton"):
        geo, kv = replace(geometry(model, cache), backend=backend), allocate(model, cache, "cpu")
        kept = keep_kv(kv, (cache.num_slots + 1) * CANVAS, model.dtype, "cpu")
        prompt = build_metadata([Row(0, 0, 13, False, blocks)], geo, layer_kinds(model), "cpu")
        model(torch.tensor(list(range(3, 16)) + [0] * (prompt.num_tokens - 13)), prompt, kv, None)
        out = []
        for mask in (np.ones_like(running), running):
            meta = build_metadata([Row(0, 13, CANVAS, True, blocks)], geo, layer_kinds(model), "cpu")
            run_active_rows(meta, mask, [0], 0, cache.num_slots, kept)
            ids = torch.tensor(canvas)[torch.from_numpy(mask[0])]
            out.append(model(torch.cat((ids, ids.new_zeros(meta.num_tokens - len(ids)))), meta, kv, None))
        assert out[1].shape[0] == int(running.sum())
        logits[backend] = torch.cat(out)
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("extra", [dict(min_tokens=2), dict(logprobs=2), dict(allowed_token_ids=[3, 4, 5]),
                                   dict(bad_words=["x"])])
def test_a_request_whose_commit_reads_the_whole_distribution_runs_exact(extra):
    """A settled position has no distribution of its own in a fast step, so a request whose
    committed canvas is chosen from the last step's whole distribution runs in the exact mode."""
    sampler = EntropyBound()
    fast = sampler.resolve(SamplingParams(denoising_mode="fast"), REFERENCE_DEFAULTS)
    assert fast.denoising_mode == "fast" and sampler.request_options(fast)["fast"]
    resolved = sampler.resolve(SamplingParams(denoising_mode="fast", **extra), REFERENCE_DEFAULTS)
    assert resolved.denoising_mode == "exact" and not sampler.request_options(resolved)["fast"]
    assert sampler.canvas_values(resolved)["settle_steps"] == 0
