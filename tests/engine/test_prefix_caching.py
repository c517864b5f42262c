"""The paged KV cache, allocated on demand, and automatic prefix caching change no output: greedy
generation with caching on equals generation with it off, and with a cache so small that requests
are preempted and recomputed. Every run prefills in chunks of one block (max_prefill_tokens = block
size), so that a token's K/V are computed by rows of the same shape with caching on and off."""

from __future__ import annotations

import argparse

from blockdiff import LLM, SamplingParams
from blockdiff.config import EngineConfig
from blockdiff.arg_utils import add_engine_args
from blockdiff.model.loader import load_model
from blockdiff.worker.kv_cache import cache_bytes_per_block, sliding_blocks_needed, sliding_bytes_per_block

GREEDY = dict(t_min=1e-6, t_max=2e-6)
BS = 16
MAX_MODEL_LEN = 128
PREFIX = [(11 * i) % 280 + 10 for i in range(40)]  # two full blocks and a tail


def _params(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, max_denoising_steps=8, seed=3, **GREEDY)


def _kv_bytes(tiny: str, blocks: int, seqs: int, prefill: int = BS) -> int:
    """--kv-cache-memory for `blocks` full-attention blocks with `seqs` sequences."""
    model = load_model(tiny)
    sliding = sliding_blocks_needed(model.config.window_past(MAX_MODEL_LEN), model.config.canvas_length, BS, seqs, prefill)
    return sliding_bytes_per_block(model, BS) * sliding + cache_bytes_per_block(model, BS) * blocks


def _llm(tiny: str, caching: bool, **kw) -> LLM:
    kw.setdefault("max_prefill_tokens", BS)
    return LLM(tiny, enable_prefix_caching=caching, block_size=BS, max_model_len=MAX_MODEL_LEN, **kw)


def test_caching_on_equals_off_for_hits_of_every_kind(tiny):
    """One request at a time: alone, then requests that hit its prefix (ending inside a block, covering
    the whole prompt) and one that hits its prompt and committed canvases (a next turn)."""
    first = PREFIX + [60, 61, 62]
    outputs, cached = {}, {}
    for caching in (False, True):
        with _llm(tiny, caching, max_num_seqs=1) as llm:
            [alone] = llm.generate([first], _params(), use_tqdm=False)
            turn = first + alone.token_ids + [63, 64]
            prompts = [PREFIX[:36] + [70, 71], PREFIX[:32], turn]
            outs = llm.generate(prompts, _params(), use_tqdm=False)
            outputs[caching] = [alone.token_ids] + [o.token_ids for o in outs]
            cached[caching] = [alone.num_cached_tokens] + [o.num_cached_tokens for o in outs]
            assert not llm.engine.has_unfinished() and llm.engine.kv.full.used == 0
    assert outputs[True] == outputs[False]
    assert cached == {False: [0, 0, 0, 0], True: [0, 32, 32, (len(first) + 16) // BS * BS]}


def test_a_tiny_cache_preempts_and_changes_no_output(tiny):
    """Four requests that need 3 blocks each at their end, three slots and 5 blocks: the newest are
    preempted when blocks run out, recomputed later, and every request commits the same tokens as
    with a cache for all of them; with caching on and off."""
    prompts = [PREFIX[:20], PREFIX[:18] + [90, 91, 92], [5, 6, 7] * 6, PREFIX[:24]]
    with _llm(tiny, True, max_num_seqs=3) as llm:
        want = [o.token_ids for o in llm.generate(prompts, _params(24), use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions == 0
    for caching in (True, False):
        with _llm(tiny, caching, max_num_seqs=3, kv_cache_memory=_kv_bytes(tiny, 5, 3)) as llm:
            assert llm.engine.kv.full.num_blocks == 5
            got = [o.token_ids for o in llm.generate(prompts, _params(24), use_tqdm=False)]
            assert llm.engine.scheduler.num_preemptions > 0
            assert got == want, caching
            assert llm.engine.kv.full.used == 0 and llm.engine.kv.sliding.used == 0


def test_admission_by_need_runs_three_times_more_short_requests(tiny):
    """A cache sized for 4 requests of max_model_len tokens: reserving each request's worst case
    (max_tokens unset: the rest of the context) admitted 4 at once; admitting by what a request
    needs now runs 16, the slots there are."""
    blocks = 4 * MAX_MODEL_LEN // BS
    with _llm(tiny, True, max_num_seqs=16, kv_cache_memory=_kv_bytes(tiny, blocks, 16, EngineConfig.max_prefill_tokens), preempt_after_canvases=None,
              max_prefill_tokens=EngineConfig.max_prefill_tokens) as llm:
        engine = llm.engine
        reqs = [engine.add_request([5 + i, 6, 7], SamplingParams(**GREEDY)) for i in range(16)]
        worst = -(-reqs[0].max_cached_tokens // BS)
        assert engine.kv.full.num_blocks == blocks and blocks // worst == 4
        engine.step()
        assert engine.num_running == 16 >= 3 * (blocks // worst)
        for r in reqs:
            engine.abort(r.request_id)
        assert engine.kv.full.used == 0


def test_prefix_caching_flag_and_engine_config_default():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).enable_prefix_caching is EngineConfig.enable_prefix_caching is True
    assert p.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert p.parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True
