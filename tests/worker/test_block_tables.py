"""The step contract sends only what changed: each rank keeps the block tables,
positions and sampler parameters of every slot on its device (worker/block_tables.py,
worker/request_slots.py) and a plan carries the new table entries (step.TableDelta) and the
requests that took a slot (step.NewRequests), both from engine/worker_record.py. The workers' tables
equal the engine's after every step, through admissions, growth, sliding blocks given back,
prefix-cache hits and preemptions; a steady-state step's message to the tensor-parallel workers is
the same size at a short and a long context, and carries no per-canvas sampler parameter."""

from __future__ import annotations

import struct

from blockdiff import LLM, SamplingParams
from blockdiff.executor.tensor_parallel import _execute
from blockdiff.model.loader import load_model
from blockdiff.parallel.ranks import _dumps, message_bytes
from blockdiff.worker.kv_cache import cache_bytes_per_block, sliding_blocks_needed, sliding_bytes_per_block

BS = 4


def _check_tables(engine) -> int:
    """Every running request's tables on the worker equal the engine's: -> how many were checked."""
    tables = engine.executor.runner.tables.tables
    checked = 0
    for req in engine.scheduler.running:
        full = tables[False][req.slot]
        assert full[: len(req.blocks)].tolist() == req.blocks and bool((full[len(req.blocks):] == -1).all())
        sliding = tables[True][req.slot, : len(req.sliding_blocks)].tolist()
        # A sliding block given back stays in the worker's table: out of every query's reach.
        assert all(b == s for b, s in zip(req.sliding_blocks, sliding) if b >= 0)
        checked += 1
    return checked


def test_the_workers_tables_follow_the_engines_through_hits_and_preemptions(tiny):
    prefix = [(7 * i) % 280 + 10 for i in range(21)]
    prompts = [prefix + [3], prefix + [4, 5], [9] * 30, prefix[:13], [6, 7] * 9]
    params = SamplingParams(max_tokens=24, max_denoising_steps=3, seed=5, ignore_eos=True)
    # 20 blocks of 4 positions for four running requests of up to 56 positions: some are preempted.
    model = load_model(tiny)
    sliding = sliding_blocks_needed(model.config.window_past(64), model.config.canvas_length, BS, 4, 16)
    memory = sliding_bytes_per_block(model, BS) * sliding + cache_bytes_per_block(model, BS) * 20
    with LLM(tiny, block_size=BS, max_model_len=64, max_num_seqs=4, kv_cache_memory=memory, max_prefill_tokens=16) as llm:
        engine = llm.engine
        for p in prompts:
            engine.add_request(p, params)
        checked, steps, execute = [0], [0], engine.executor.execute

        def checking(plan):
            # When a step has run, its tables are the engine's as they were at its plan, and they stay
            # so until the engine has its results (with async scheduling, the next plan is made then).
            out = execute(plan)
            checked[0] += _check_tables(engine)
            steps[0] += 1
            return out

        engine.executor.execute = checking
        while engine.has_unfinished():
            engine.step()
        assert engine.scheduler.num_preemptions > 0 and engine.kv.hits > 0 and checked[0] > steps[0]


def _steady_bytes(llm: LLM, prompt_len: int) -> set[int]:
    """Bytes of each all-canvas step's message that starts no canvas, for one request."""
    engine, sizes = llm.engine, set()
    execute = engine.executor.execute

    def measure(plan):
        if plan.denoise is not None and not plan.new_canvas_rows and all(r.decoder for r in plan.rows):
            sizes.add(message_bytes(_execute, plan))
        return execute(plan)

    engine.executor.execute = measure
    try:
        llm.generate([[5 + i % 250 for i in range(prompt_len)]],
                     SamplingParams(max_tokens=16, max_denoising_steps=16, seed=1, ignore_eos=True), use_tqdm=False)
    finally:
        engine.executor.execute = execute
    return sizes


def test_a_steady_state_step_sends_the_same_bytes_at_any_context(tiny):
    with LLM(tiny, block_size=BS, max_model_len=1024) as llm:
        short, long = _steady_bytes(llm, 20), _steady_bytes(llm, 900)
    assert short and long
    # Row.start grows from one to two bytes of pickle; the long request's table is 230 entries.
    assert max(long) - min(short) <= 8, (short, long)


def _messages(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[object, bytes]]:
    """Each plan of a generation and the message it is to the tensor-parallel workers."""
    engine, sent = llm.engine, []
    execute = engine.executor.execute

    def record(plan):
        sent.append((plan, _dumps((_execute, (plan,), False))))
        return execute(plan)

    engine.executor.execute = record
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.executor.execute = execute
    return sent


def _steady(sent: list[tuple[object, bytes]]) -> list[bytes]:
    """The messages of steps of canvases that go on: no request took a slot, no canvas starts."""
    return [m for plan, m in sent if plan.denoise is not None and not plan.new_canvas_rows
            and getattr(plan, "new_requests", None) is None and all(r.decoder for r in plan.rows)]


def test_a_steady_state_step_carries_no_per_canvas_sampler_parameters(tiny):
    """Four canvases whose requests differ in seed, temperature, entropy bound, top-p and steps send
    the same steady-state message as four alike: each request's values go out once, when it takes
    its slot, and never again (its float32 and seed bytes are not in any later step's message); a
    canvas adds only its row to a step's message."""
    prompts = [[5 + (3 * i + j) % 250 for j in range(20)] for i in range(4)]
    base = dict(max_tokens=32, max_denoising_steps=12, ignore_eos=True, confidence_threshold=0.0)
    alike = [SamplingParams(**base, seed=1)] * 4
    seeds = [0x5EED0001 + 977 * i for i in range(4)]
    bounds = [0.0123457 + 0.001 * i for i in range(4)]
    differ = [SamplingParams(**{**base, "max_denoising_steps": 12 + i}, seed=seeds[i], temperature=0.5 + 0.25 * i,
                             entropy_bound=bounds[i], top_p=0.9 + 0.01 * i) for i in range(4)]
    with LLM(tiny, block_size=BS, max_model_len=256, max_num_seqs=4) as llm:
        one = _messages(llm, prompts[:1], alike[:1])
        same = _messages(llm, prompts, alike)
        different = _messages(llm, prompts, differ)
    assert _steady(one) and _steady(same) and _steady(different)
    # sent as plain values (NewRequests), as pickle writes them: an int of 4 bytes, a float of 8
    marks = [b"J" + struct.pack("<i", s) for s in seeds] + [b"G" + struct.pack(">d", b) for b in bounds]
    assert all(mark in b"".join(m for _, m in different) for mark in marks)  # the check sees them where they are sent
    assert not any(mark in m for m in _steady(different) for mark in marks)
    # top-p in the second batch chooses the restricted draw, a step option: the same size either way
    def sizes(sent):  # by the step's shape: canvases and steps per launch
        return {(len(p.rows), p.steps, p.tables is None): len(m) for p, m in sent if m in _steady(sent)}

    common = sizes(same).keys() & sizes(different).keys()
    assert common and all(sizes(same)[k] == sizes(different)[k] for k in common), (sizes(same), sizes(different))
    per_canvas = (min(len(m) for m in _steady(same)) - min(len(m) for m in _steady(one))) / 3
    assert 0 < per_canvas <= 32, per_canvas  # a row (slot, length, kind); its parameters were ~90 bytes
