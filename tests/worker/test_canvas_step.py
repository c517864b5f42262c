"""The static denoising step (worker/canvas_step.py): traced whole by torch.compile(fullgraph=True),
so it has no host sync and no graph break, with the same tokens as the eager path and as
transformers; its MoE and attention alone trace the same way; on CUDA, graph replay equals eager.

Dynamo's graph-only backends check the graphs without generating code; the inductor-compiled
engine (what --compile runs) is slower still. Only the MoE/attention trace is in the default run."""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers import hf_generate_with_draft, load_hf, new_requests, whole_tables

from blockdiff import LLM, SamplingParams
from blockdiff.arg_utils import add_engine_args, engine_config
from blockdiff.ops.kernels import expert_kernel, static_kernel, target
from blockdiff.model.attention import canvas_metadata
from blockdiff.model.loader import load_model
from blockdiff.step import CacheConfig
from blockdiff.worker.block_tables import BlockTables
from blockdiff.diffusion.entropy_bound import EntropyBound, denoise_params
from blockdiff.model.attention import Row
from blockdiff.sampling_params import REFERENCE_DEFAULTS
from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.worker.canvas_step import (
    COMPILE_OPTIONS, CanvasInputs, CanvasSteps, canvas_step, context_of, shape_count,
)
from blockdiff.worker.kv_cache import allocate, geometry
from blockdiff.worker.penalties import SlotPenalties
from blockdiff.worker.request_slots import RequestSlots

GREEDY = dict(t_min=1e-6, t_max=2e-6)
STEPS, MAX_TOKENS = 4, 16  # two canvases of 8


def _prompts(vocab: int) -> list[list[int]]:
    return [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 5, 12)]


def _draft(prompt: list[int]) -> list[int]:
    """The canvases' starting tokens, the same on both sides (noise is drawn differently)."""
    return torch.randint(3, 301, (MAX_TOKENS,), generator=torch.Generator().manual_seed(100 + len(prompt))).tolist()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=MAX_TOKENS, max_denoising_steps=STEPS, draft=_draft(p), **GREEDY) for p in prompts]
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate, cut after its first EOS like ours."""
    hf = load_hf(path)
    eos = set(hf.generation_config.eos_token_id or [])
    out = []
    for p in prompts:
        tokens = hf_generate_with_draft(hf, p, _draft(p), max_new_tokens=MAX_TOKENS, max_denoising_steps=STEPS, **GREEDY)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), MAX_TOKENS)
        out.append(tokens[:cut])
    return out


def _trace_with_dynamo(llm: LLM) -> dict[str, int]:
    """Runs the engine's static step through torch.compile(fullgraph=True) with dynamo's graph-only
    backend; counts the graphs it made."""
    steps = llm.engine.executor.runner.canvas_steps
    assert steps is not None
    counter = {"graphs": 0}

    def backend(gm, example_inputs):
        counter["graphs"] += 1
        return gm.forward

    steps.fn = torch.compile(canvas_step, fullgraph=True, backend=backend)
    return counter


@pytest.mark.slow  # three engines, transformers and two dynamo traces: ~70 s of CPU here
def test_fullgraph_step_matches_eager_and_transformers(tiny):
    """One canvas alone, then three in a batch of bucket 4 (one padded canvas): the step traced whole
    with fullgraph=True gives the eager engine's tokens, which are transformers' greedy tokens."""
    prompts = _prompts(301)
    want = _reference(tiny, prompts)
    with LLM(tiny) as llm:
        steps = llm.engine.executor.runner.canvas_steps  # the CPU default: eager (docs/benchmarks.md)
        assert steps is None or steps.fn is canvas_step
        eager = _generate(llm, prompts[:1]) + _generate(llm, prompts)
    with LLM(tiny, compile=True) as llm:
        counter = _trace_with_dynamo(llm)
        traced = _generate(llm, prompts[:1]) + _generate(llm, prompts)
    assert counter["graphs"] >= 1
    assert eager == traced == want[:1] + want


def test_moe_and_attention_trace_without_host_sync(tiny):
    """A block's experts and its attention over canvases compile with fullgraph=True: a `.tolist()`,
    `.item()` or data-dependent shape inside either is a graph break, which fullgraph refuses."""
    model = load_model(tiny)
    layer = model.layers[0]
    n, k = 24, model.config.arch.top_k_experts
    x = torch.randn(n, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, index = layer.router(x)
    with torch.inference_mode():
        want = layer.experts(x, weights, index)
        got = torch.compile(layer.experts, fullgraph=True, backend="eager")(x, weights, index)
    assert index.shape == (n, k)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    cache = CacheConfig(num_slots=3, num_blocks=12, block_size=4, max_model_len=48)
    kv = allocate(model, cache, "cpu")
    for k_cache, v_cache in kv:
        k_cache.normal_(generator=torch.Generator().manual_seed(1))
        v_cache.normal_(generator=torch.Generator().manual_seed(2))
    geo = geometry(model, cache)
    cl = model.config.canvas_length
    starts = torch.tensor([0, 5, 13])
    tables = {s: torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]) for s in (True, False)}
    spec = model.config.arch.layers[0]

    def attend(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        meta = canvas_metadata(starts, tables, cl, 16, geo)
        kind = meta.kind(spec.sliding)
        kind.cos, kind.sin = model.rotary["sliding" if spec.sliding else "full"].cos_sin(meta.positions, x.dtype)
        return layer.attn(x, meta, kv[0])

    h = torch.randn(3 * cl, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = attend(h, starts)
        got = torch.compile(attend, fullgraph=True, backend="eager")(h, starts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow
def test_inductor_compiled_engine_greedy_parity(tiny):
    """The engine as --compile runs it (inductor's generated code) against transformers."""
    prompts = _prompts(301)
    with LLM(tiny, compile=True) as llm:
        got = _generate(llm, prompts)
    assert got == _reference(tiny, prompts)


def _tensors(out) -> dict[str, torch.Tensor]:
    """A static step's outputs by name."""
    return {**{f"updates.{k}": v for k, v in out.updates.items()}, "tokens": out.tokens, "finished": out.finished,
            "logprob": out.logprob}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("compile", [False, True], ids=["eager-graphs", "compiled-graphs"])
def test_cuda_graph_replay_equals_eager(tiny, compile):
    """On CUDA (bfloat16, where torch has grouped_mm) each static step shape is captured once and
    replayed: every captured graph's outputs equal the same step function run without the graph
    on the same inputs. Compiled, the engine's tokens also equal those of --enforce-eager --compile
    (the same compiled steps without graphs; without --compile, --enforce-eager runs the eager
    grouped-rows forward, whose bfloat16 numbers differ)."""
    if not static_kernel(expert_kernel(target("cuda"), torch.bfloat16, load_model(tiny, torch.bfloat16).layers[0].experts.shape)[0]):
        pytest.skip("torch has no grouped_mm without a host sync for bfloat16 on this GPU")
    prompts = _prompts(301)
    with LLM(tiny, device="cuda", dtype="bfloat16", compile=compile) as llm:
        got = _generate(llm, prompts[:1]) + _generate(llm, prompts)
        steps = llm.engine.executor.runner.canvas_steps
        assert steps.shapes and all(graph is not None for _, graph, _ in steps.shapes.values())
        for (_, context, options, n, _), (inputs, graph, outputs) in steps.shapes.items():  # keys: (size, context, options, steps, penalized)
            graph.replay()
            replayed = {k: v.clone() for k, v in _tensors(outputs).items()}
            with torch.inference_mode():  # as the runner calls it
                direct = steps.fn(*steps.step_args(context, inputs, dict(options), n))
            for name, value in _tensors(direct).items():
                assert torch.equal(value, replayed[name]), name
        # Every captured graph's logits are the one shared buffer's.
        buffer = steps.logits.untyped_storage().data_ptr()
        assert {out.dist.shifted.untyped_storage().data_ptr() for _, _, out in steps.shapes.values()} == {buffer}
    if compile:
        with LLM(tiny, device="cuda", dtype="bfloat16", compile=True, enforce_eager=True) as llm:
            assert llm.engine.executor.runner.canvas_steps.pool is None
            assert got == _generate(llm, prompts[:1]) + _generate(llm, prompts)


def test_compile_flags_reach_the_engine_config(tiny):
    """--compile/--no-compile/--enforce-eager become EngineConfig fields; (compile, cuda_graphs) per
    device follow vLLM's meaning of --enforce-eager; a bad value names the field."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    modes = {}
    for flags in ([], ["--compile"], ["--no-compile"], ["--enforce-eager"], ["--enforce-eager", "--compile"]):
        args = p.parse_args(flags + ["--model", tiny])
        cfg = engine_config(args)
        modes[" ".join(flags)] = (cfg.step_modes("cpu"), cfg.step_modes("cuda"))
    assert modes == {
        "": ((None, False), (None, True)),
        "--compile": ((True, False), (True, True)),
        "--no-compile": ((False, False), (False, True)),
        "--enforce-eager": ((False, False), (False, False)),
        "--enforce-eager --compile": ((True, False), (True, False)),
    }
    with pytest.raises(ValueError, match="compile must be"):
        LLM(tiny, compile="yes")


def test_the_compiled_step_may_take_every_shape_of_its_engine():
    """The recompile limit of the compiled step is the number of shapes the engine can meet: 5
    buckets up to 16 canvases, 11 contexts up to 8,192 positions (0, then 1 to 512 blocks of 16),
    with and without top-k/p: 110, where dynamo stops at 8 by default."""
    assert shape_count(16, 8192, 16) == 5 * 11 * 2 > torch._dynamo.config.recompile_limit
    assert shape_count(4, 64, 4) == 3 * 6 * 2 and shape_count(33, 16, 16) == 7 * 2 * 2 and shape_count(1, 0, 16) == 4


def _canvas_steps(checkpoints, slots: int, blocks: int, compile: bool):
    """A static step's parts on a two-layer random model, outside an engine: (cache config, block
    tables, request slots, CanvasSteps, with the slots' penalties); the slots' canvases hold random tokens."""
    model = load_model(checkpoints("two-layers", vocab_size=301, canvas_length=8, sliding_window=6, num_layers=2, seed=3))
    cache = CacheConfig(num_slots=slots, num_blocks=blocks, block_size=4, max_model_len=64)
    sampler, cpu = EntropyBound(), torch.device("cpu")
    state = sampler.new_state(slots + 1, model.config.canvas_length, model.config.hidden_size, model.dtype, cpu)
    state.canvas.copy_(torch.randint(3, 301, state.canvas.shape, generator=torch.Generator().manual_seed(0)))
    tables = BlockTables(cache, {False, True}, cpu)
    requests = RequestSlots(sampler, slots + 1, cpu)
    steps = CanvasSteps(model, sampler, VocabParallel(model.shard, model.group), allocate(model, cache, "cpu"),
                        geometry(model, cache), tables.tables, state, requests, cpu, compile=compile, cuda_graphs=False,
                        penalties=SlotPenalties(slots + 1, model.shard, cpu))
    return cache, tables, requests, steps


@pytest.mark.slow  # 12 dynamo traces of the whole step: ~18 s of CPU, 30-40 s on a shared machine
def test_a_compiled_step_goes_through_every_shape_the_engine_meets(checkpoints):
    """More shapes than dynamo's default recompile limit (8): buckets 1, 2 and 4 at three or four
    contexts, two with top-k sampling, through the step compiled with the engine's options (dynamo's
    graph-only backend: the graphs, no generated code). Each shape's outputs equal the eager step's."""
    # dynamo counts the entries of canvas_step's code object, which this file's other compiled steps
    # also filled: the engine's limit is sized for one engine's shapes, so start from none.
    torch._dynamo.reset()
    cache, tables, requests, steps = _canvas_steps(checkpoints, 4, 64, compile=True)
    cl = steps.state.canvas.shape[1]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    steps.fn = torch.compile(canvas_step, backend=backend, **COMPILE_OPTIONS)
    shapes = [(n, start, False) for n in (1, 2, 4) for start in (0, 3, 15)] + [(1, 40, False), (2, 3, True), (4, 40, True)]
    with torch.inference_mode():
        for n, start, restrict in shapes:
            rows = [Row(slot, start, cl, True, tuple(range(16 * slot, 16 * slot + 16))) for slot in range(n)]
            resolved = [EntropyBound().resolve(SamplingParams(top_k=5 if restrict else -1), REFERENCE_DEFAULTS)] * n
            params = denoise_params([3] * n, resolved, list(range(n)))
            tables.apply(whole_tables(rows))
            requests.admit(new_requests(rows, [3] * n, resolved, list(range(n))))
            steps(rows, params.options())
    assert len(steps.shapes) == len(graphs) == 12 > torch._dynamo.config.recompile_limit
    for (size, context, options, _, _), (inputs, _, _) in steps.shapes.items():  # keys: (size, context, options, steps, penalized)
        with torch.inference_mode():
            compiled = steps.fn(*steps.step_args(context, inputs, dict(options)))
            eager = canvas_step(*steps.step_args(context, inputs, dict(options)))
        assert compiled.updates["soft"].shape[0] == size == inputs.slots.shape[0]
        for name, value in {**eager.updates, **eager.__dict__}.items():  # eager products: oneDNN on AVX-512
            if isinstance(value, torch.Tensor):  # not the updates dict nor the distribution statistics
                got = compiled.updates[name] if name in compiled.updates else getattr(compiled, name)
                torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-5, msg=f"{size, context, name}")


def test_steps_of_two_buckets_write_their_logits_into_one_buffer(checkpoints):
    """canvas_step with a logits buffer (what CanvasSteps hands every captured CUDA graph): the
    steps of 1 and 2 canvases both leave their distribution in that buffer, and their outputs are
    those of the step that makes its own logits."""
    cache, tables, requests, steps = _canvas_steps(checkpoints, 2, 32, compile=False)
    cl, sampler = steps.state.canvas.shape[1], steps.sampler
    buffer = torch.empty(2 * cl, steps.model.shard.local_rows)
    for n in (1, 2):
        rows = [Row(slot, 5, cl, True, tuple(range(16 * slot, 16 * slot + 16))) for slot in range(n)]
        resolved = [sampler.resolve(SamplingParams(), REFERENCE_DEFAULTS)] * n
        params = denoise_params([3] * n, resolved, list(range(n)))
        tables.apply(whole_tables(rows))
        requests.admit(new_requests(rows, [3] * n, resolved, list(range(n))))
        inputs = CanvasInputs(torch.arange(n))
        with torch.inference_mode():
            steps.logits = None
            fresh = canvas_step(*steps.step_args(context_of(rows, cache.block_size), inputs, params.options()))
            steps.logits = buffer
            shared = canvas_step(*steps.step_args(context_of(rows, cache.block_size), inputs, params.options()))
        assert shared.dist.shifted.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert fresh.dist.shifted.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
        for name, value in _tensors(fresh).items():
            assert torch.equal(value, _tensors(shared)[name]), name


def _soft_inputs(llm: LLM, prompts, params) -> tuple[list[torch.Tensor | None], list[list[int]]]:
    """The self-conditioning input of the canvases' tokens at every step that denoised some, and the
    outputs: read at the model's self-conditioning module, where a step's two paths meet."""
    model = llm.engine.executor.runner.model
    seen = []
    hook = model.self_conditioning.register_forward_hook(
        lambda module, args, out: seen.append(None if args[1] is None else args[1].clone()))
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        hook.remove()
    return seen, tokens


def test_a_starting_canvas_is_self_conditioned_alike_on_the_eager_and_the_static_step(tiny):
    """One step function with one rule (worker/canvas_step.forward_step): a starting canvas reads
    its slot's zeros whichever path runs it, and a finished canvas's soft embeddings are computed
    too, so the static step (num_scheduler_steps 2 runs every all-canvas step through it) and the
    eager step give the model the same inputs and the slots the same state."""
    prompts = [[5, 6, 7], [9, 10]]
    params = [SamplingParams(max_tokens=16, max_denoising_steps=3, seed=7, ignore_eos=True) for _ in prompts]
    runs = {}
    for k in (1, 2):
        with LLM(tiny, num_scheduler_steps=k) as llm:
            runs[k] = _soft_inputs(llm, prompts, params)
            runner = llm.engine.executor.runner
            assert (runner.canvas_steps is None) == (k == 1)
            runs[k] += (runner.state.soft.clone(),)
    (eager, eager_tokens, eager_state), (static, static_tokens, static_state) = runs[1], runs[2]
    assert eager_tokens == static_tokens
    # A canvas's first step reads zeros, not "no input", on the eager path too.
    assert eager[0] is not None and eager[0].count_nonzero() == 0
    assert all(s is not None for s in eager + static)
    canvas_steps = [s for s in eager if s.shape[0]]
    assert len(canvas_steps) >= 6
    # The finished canvases' slots hold the soft embeddings of their last step on both paths.
    assert torch.equal(eager_state[: len(prompts)], static_state[: len(prompts)])
    assert eager_state[: len(prompts)].count_nonzero() > 0


@pytest.mark.slow  # 75 s of inductor compiling here
def test_a_launch_of_several_steps_compiles_through_inductor_on_the_cpu(checkpoints):
    """Three denoising steps in one compiled launch, through inductor's CPU code (not a tracing-only
    backend): a step's new state, written in place into the launch's working copy and read back by
    the next step's norms, broke inductor's loop fusion at canvas 256 and hidden size 64 (KeyError:
    'buf444', torch 2.13). The launch now takes each step's state as it is. Inductor's fused
    arithmetic rounds otherwise than eager, and a random model's flat distributions follow the last
    bits, so the check is that the launch compiles and runs, not that its draws equal eager's."""
    path = checkpoints("canvas 256", vocab_size=512, hidden_size=64, num_layers=2, num_experts=4, canvas_length=256,
                       tokenizer=False)
    prompts = [[2] + torch.randint(3, 512, (15,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    params = SamplingParams(max_tokens=256, max_denoising_steps=3, stability_threshold=3, ignore_eos=True, seed=0)
    with LLM(path, compile=True, max_num_seqs=2, max_model_len=16 + 256) as llm:  # benchmarks/step_memory.py's
        assert llm.engine.executor.runner.steps_per_launch > 1
        outs = [o.token_ids for n in (1, 2) for o in llm.generate(prompts[:n], params, use_tqdm=False)]
    assert [len(t) for t in outs] == [256] * 3 and all(0 <= t < 512 for ids in outs for t in ids)
