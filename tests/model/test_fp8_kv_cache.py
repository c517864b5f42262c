"""The FP8 KV cache (--kv-cache-dtype fp8, docs/fp8.md "FP8 KV cache"): K and V stored as
float8_e4m3fn with a K and a V scale per layer, quantized on their way into the cache and
dequantized inside attention.

E4M3 keeps 3 mantissa bits: rounding to nearest puts each entry within U = 2^-4 of its value
(relative), or within 2^-10 of the scale below 2^-6 x scale (the subnormals, absolute). The bounds
below are computed from these two numbers."""

from __future__ import annotations

import argparse
import math
import shutil
from pathlib import Path
from dataclasses import replace

import pytest
import torch
from helpers import hf_generate_with_draft, load_hf
from safetensors.torch import load_file, save_file

from blockdiff import LLM, SamplingParams
from blockdiff.arg_utils import add_engine_args, engine_config
from blockdiff.demo import demo_checkpoint
from blockdiff.engine.startup import summary
from blockdiff.model.attention import Attention, CacheGeometry, Row, build_metadata
from blockdiff.model.interface import layer_kinds
from blockdiff.model.loader import load_model
from blockdiff.parallel.quantization.base import QuantizationError
from blockdiff.parallel.quantization.registry import parse_quantization
from blockdiff.step import CacheConfig
from blockdiff.worker.kv_cache import allocate, geometry

GREEDY = dict(t_min=1e-6, t_max=2e-6)
U = 2.0**-4  # E4M3's unit roundoff: half an ulp of 3 mantissa bits, relative
SUBNORMAL = 2.0**-10  # half its smallest step (2^-9), absolute, in units of the scale


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Sequence:
    """One sequence through a model and a cache of `kv_cache_dtype` (tests/helpers.py's Harness, with
    the cache's dtype)."""

    def __init__(self, model, kv_cache_dtype: str, max_len: int = 128, block_size: int = 8):
        cfg = CacheConfig(1, max_len // block_size, block_size, max_len, kv_cache_dtype=kv_cache_dtype)
        self.model, self.kv, self.geo = model, allocate(model, cfg, "cpu"), geometry(model, cfg)
        self.blocks, self.length = tuple(range(cfg.num_blocks)), 0

    @torch.no_grad()
    def run(self, ids: list[int], decoder: bool) -> torch.Tensor:
        meta = build_metadata([Row(0, self.length, len(ids), decoder, self.blocks)], self.geo,
                              layer_kinds(self.model), "cpu")
        out = self.model(torch.tensor(ids + [0] * (meta.num_tokens - len(ids))), meta, self.kv)
        if not decoder:
            self.length += len(ids)
        return out


def test_greedy_against_transformers_and_the_logits_error_bound():
    """The demo checkpoint (float32, trained): greedy generation with an FP8 cache against
    transformers' (float32 KV) over 3 prompts, reporting where the tokens first differ; and the first
    denoising step's logits against the unquantized cache's.

    The budget, a first-order one (a rigorous bound needs the network's Jacobian; the attention's
    own is test_attention_error_within_the_e4m3_bound): each cached K and V entry is off by at most U
    of itself. An attention layer's output is a convex combination of its values, so values off by U
    move it by U of their scale, and keys off by U its weights by about U more; the errors of the
    layers that read the cache add up at first order, and the norms keep each at the residual
    stream's scale: layers x 2U of the largest logit (0.5 for the demo's 4 layers; measured 0.12)."""
    path = demo_checkpoint()
    vocab = 112
    prompts = [_tokens(n, vocab, 100 + n) for n in (3, 11, 23)]
    drafts = [_tokens(24, vocab, 200 + n) for n in (3, 11, 23)]
    params = [SamplingParams(max_tokens=24, max_denoising_steps=6, draft=d, **GREEDY) for d in drafts]
    outs = {}
    for dtype in ("auto", "fp8"):
        with LLM(path, device="cpu", kv_cache_dtype=dtype) as llm:
            outs[dtype] = llm.generate(prompts, params, use_tqdm=False)
    hf = load_hf(path)
    eos = set(hf.generation_config.eos_token_id or [])
    for i, (prompt, draft) in enumerate(zip(prompts, drafts)):
        want = hf_generate_with_draft(hf, prompt, draft, max_new_tokens=24, max_denoising_steps=6, **GREEDY)
        want = want[: next((j + 1 for j, t in enumerate(want) if t in eos), 24)]
        assert outs["auto"][i].token_ids == want  # the comparison itself is sound
        got = outs["fp8"][i].token_ids
        first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None and len(got) != len(want):
            first = min(len(got), len(want))
        print(f"prompt of {len(prompt)}: fp8 tokens first differ from transformers' at "
              f"{'none' if first is None else first} ({len(got)} tokens, transformers' {len(want)})")

    model = load_model(path, dtype=torch.float32)
    layers = sum(1 for m in model.modules() if isinstance(m, Attention))
    for prompt, draft in zip(prompts, drafts):
        exact, fp8 = _Sequence(model, "auto"), _Sequence(model, "fp8")
        for s in (exact, fp8):
            s.run(prompt, decoder=False)
        want, got = exact.run(draft[:8], decoder=True), fp8.run(draft[:8], decoder=True)
        err = (got - want).abs().max().item()
        bound = layers * 2 * U * want.abs().max().item()
        print(f"prompt of {len(prompt)}: max |logit diff| {err:.4f}, bound {bound:.4f}")
        assert err <= bound, f"max |logit diff| {err} over the bound {bound}"
        assert err > 0  # the cache is quantized at all


def test_fp8_logits_are_those_of_the_dequantized_cache(tiny):
    """All the error is the quantization's: the logits of an FP8 cache (scales other than 1) equal
    those of a float32 cache holding its dequantized entries."""
    model = load_model(tiny, dtype=torch.float32)
    for i, m in enumerate(a for a in model.modules() if isinstance(a, Attention)):
        m.k_scale.fill_(0.01 * (i + 1))
        m.v_scale.fill_(0.02 * (i + 1))
    prompt, canvas = _tokens(11, 301, 1), _tokens(8, 301, 2)
    fp8, plain = _Sequence(model, "fp8"), _Sequence(model, "auto")
    fp8.run(prompt, decoder=False)
    scales = [(m.k_scale, m.v_scale) for m in model.modules() if isinstance(m, Attention)]
    for (k8, v8), (k, v), (ks, vs) in zip(fp8.kv, plain.kv, scales):
        assert k8.dtype == torch.float8_e4m3fn
        k.copy_(k8.float() * ks)
        v.copy_(v8.float() * vs)
    plain.length = fp8.length
    # float32 rounding apart: the scale multiplies q.k here and k there
    torch.testing.assert_close(fp8.run(canvas, decoder=True), plain.run(canvas, decoder=True), rtol=1e-4, atol=1e-4)


def test_attention_error_within_the_e4m3_bound():
    """One attention call (reference backend) of canvases over an FP8 cache against a float32 one,
    each output element within the bound computed from U: key entries off by dk make a score off by
    at most D = sum |q| dk, so each weight moves by a factor within e^(±2D), and
    |out - exact| <= max dv + (e^(2D) - 1) sum p |v|."""
    g = torch.Generator().manual_seed(0)
    block, heads, dim, start, length = 4, 2, 16, 24, 8
    geo = CacheGeometry(block_size=block, window_past=0, window=None)
    q, k, v = (torch.randn(start + length, h, dim, generator=g) for h in (heads, 1, 1))
    row = Row(0, start, length, True, tuple(range((start + length) // block)))
    scales = (torch.tensor(0.01), torch.tensor(0.02))
    out = {}
    for name, dtype, s in (("exact", torch.float32, None), ("fp8", torch.float8_e4m3fn, scales)):
        cache = (torch.zeros(1, 64, dim, dtype=dtype), torch.zeros(1, 64, dim, dtype=dtype))
        prefix = build_metadata([Row(0, 0, start, False, row.blocks)], geo, {False}, "cpu").full
        prefix.write(k[:start], v[:start], cache, s)
        kind = build_metadata([row], geo, {False}, "cpu").full
        out[name] = kind.attend(q[start:], k[start:], v[start:], cache, s).view(length, heads, dim)

    def error(x, scale):  # the most E4M3 rounding moves each entry, scaled
        return torch.maximum(U * x.abs(), torch.full_like(x, SUBNORMAL * scale))

    dk = torch.cat((error(k[:start, 0], scales[0].item()), torch.zeros(length, dim)))  # own keys are exact
    dv = torch.cat((error(v[:start, 0], scales[1].item()), torch.zeros(length, dim)))
    qs = q[start:]  # [length, heads, dim]
    p = torch.softmax(qs @ k[:, 0].T, -1)  # [length, heads, keys]
    d = (qs.abs() @ dk.T).amax(-1, keepdim=True)  # [length, heads, 1]
    bound = dv.amax(0) + (torch.exp(2 * d) - 1) * (p @ v[:, 0].abs())
    err = (out["fp8"] - out["exact"]).abs()
    assert (err <= bound * (1 + 1e-4) + 1e-6).all(), f"worst error / bound {(err / bound).max().item()}"
    assert err.max() > 0


def test_the_cache_admits_twice_the_tokens(tiny):
    """For the same --kv-cache-memory, an FP8 cache holds >= 1.9x the blocks of a bfloat16 one (its
    sliding blocks take half as much too), and the startup summary says which dtype it holds."""
    blocks, lines = {}, {}
    for dtype in ("auto", "fp8"):
        with LLM(tiny, device="cpu", dtype="bfloat16", kv_cache_memory=4 * 2**20, max_model_len=128,
                 kv_cache_dtype=dtype) as llm:
            cache = llm.engine.executor.cache_config
            blocks[dtype] = cache.num_blocks
            lines[dtype] = summary(llm.engine, "1")[-1]
            assert cache.kv_cache_dtype == dtype
            out = llm.generate(_tokens(5, 301, 0), SamplingParams(max_tokens=8, seed=0), use_tqdm=False)[0]
            assert len(out.token_ids) == 8
    print(f"4 MiB: {blocks['auto']} blocks bfloat16, {blocks['fp8']} fp8 ({blocks['fp8'] / blocks['auto']:.2f}x); {lines}")
    assert blocks["fp8"] >= 1.9 * blocks["auto"]
    assert "fp8" in lines["fp8"] and "bfloat16 entries" in lines["auto"]


def test_prefix_caching_hits_as_with_the_model_dtype(tiny):
    """The same hits (cached_tokens) and the same KV events with an FP8 cache as without: the cache
    manager counts and hashes blocks, whatever their entries."""
    prefix = [(11 * i) % 280 + 10 for i in range(40)]
    cached, events = {}, {"auto": [], "fp8": []}
    for dtype in ("auto", "fp8"):
        with LLM(tiny, device="cpu", kv_cache_dtype=dtype, block_size=16, max_num_seqs=1, max_prefill_tokens=16,
                 max_model_len=128) as llm:
            params = SamplingParams(max_tokens=16, max_denoising_steps=8, seed=3, **GREEDY)
            llm.engine.kv_event_sinks.append(events[dtype].extend)  # what a KV events publisher is given
            [alone] = llm.generate([prefix + [60, 61, 62]], params, use_tqdm=False)
            outs = llm.generate([prefix[:36] + [70, 71], prefix[:32], prefix + [60, 61, 62] + alone.token_ids],
                                params, use_tqdm=False)
            cached[dtype] = [alone.num_cached_tokens] + [o.num_cached_tokens for o in outs]
    assert cached["fp8"] == cached["auto"] and cached["fp8"][1:] == [32, 32, 48]
    # The same events, in order; those of the prompt's blocks equal (later blocks hold the generated
    # tokens, which the FP8 cache changes).
    assert [type(e).__name__ for e in events["fp8"]] == [type(e).__name__ for e in events["auto"]]
    assert events["fp8"][:2] == events["auto"][:2] and type(events["fp8"][0]).__name__ == "BlockStored"


# Sliding layers split 4 KV heads over 2 ranks; the full layer's one KV head is on both.
TP_SPEC = dict(vocab_size=263, hidden_size=48, intermediate_size=96, num_layers=2,
               layer_types=["sliding_attention", "full_attention"], num_heads=4, num_kv_heads=4, head_dim=8,
               global_head_dim=16, num_global_kv_heads=1, sliding_window=7, canvas_length=8, seed=11)


@pytest.mark.usefixtures("single_threaded_workers")
def test_tensor_parallel_equals_one_rank(checkpoints):
    """--calculate-kv-scales under TP 2: each rank sees only its KV heads, so the scales are the max
    over the group; then both ranks quantize as one rank does, and the tokens are one rank's."""
    path = checkpoints("fp8-tp", **TP_SPEC)
    prompts = [_tokens(3, 263, 1), _tokens(11, 263, 2)]
    params = [SamplingParams(max_tokens=16, max_denoising_steps=4, draft=_tokens(16, 263, s), **GREEDY) for s in (3, 4)]
    tokens = {}
    for tp in (1, 2):
        with LLM(path, device="cpu", tensor_parallel_size=tp, kv_cache_dtype="fp8", calculate_kv_scales=True) as llm:
            tokens[tp] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if tp == 1:
                attn = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, Attention)]
                assert all(m.k_scale.item() != 1.0 and not m.calculate_scales for m in attn)
    assert tokens[2] == tokens[1]


def test_scales_from_a_compressed_tensors_checkpoint(tiny, tmp_path):
    """self_attn.k_scale / v_scale tensors ([] or [1]) are read into their layers; absent ones stay 1.0."""
    path = tmp_path / "scaled"
    shutil.copytree(tiny, path)
    weights = load_file(path / "model.safetensors")
    prefix = next(n for n in weights if n.endswith("layers.0.self_attn.q_proj.weight")).rsplit("q_proj", 1)[0]
    weights[prefix + "k_scale"] = torch.tensor([0.25])
    weights[prefix + "v_scale"] = torch.tensor(0.5)
    save_file(weights, path / "model.safetensors")
    attn = [m for m in load_model(str(path)).modules() if isinstance(m, Attention)]
    assert (attn[0].k_scale.item(), attn[0].v_scale.item()) == (0.25, 0.5)
    assert attn[0].k_scale.dtype == torch.float32
    assert all(m.k_scale.item() == 1.0 for m in attn[1:])


def test_kv_cache_scheme_of_the_quantization_config():
    """A static per-tensor FP8 kv_cache_scheme is read (its scales are the checkpoint's k_scale /
    v_scale); other schemes are refused."""
    group = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False}}
    raw = {"quant_method": "compressed-tensors", "config_groups": {"g": group}}
    fp8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    assert parse_quantization({**raw, "kv_cache_scheme": fp8}) is not None
    with pytest.raises(QuantizationError, match="kv_cache_scheme"):
        parse_quantization({**raw, "kv_cache_scheme": {**fp8, "num_bits": 4, "type": "int"}})


def test_auto_is_the_model_dtype_and_bad_values_are_refused(tiny):
    model = load_model(tiny, dtype=torch.bfloat16)
    cfg = CacheConfig(1, 4, 4, 16)
    assert allocate(model, cfg, "cpu")[0][0].dtype == torch.bfloat16
    assert allocate(model, replace(cfg, kv_cache_dtype="fp8_e4m3"), "cpu")[0][0].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny, kv_cache_dtype="fp8_e5m2")
    assert math.isclose(U, 1 / 16)


def test_the_static_step_reads_the_fp8_cache_as_the_eager_one(tiny):
    """Steps of canvases only, run as the static step several at a launch (the path compiled and
    graphed on CUDA; --compile gave the same tokens, checked by hand: 270 s on this CPU), read the
    FP8 cache and its calculated scales as the eager steps do."""
    prompts = [_tokens(3, 301, 5), _tokens(11, 301, 6)]
    params = [SamplingParams(max_tokens=24, max_denoising_steps=6, draft=_tokens(24, 301, s), **GREEDY) for s in (7, 8)]
    tokens = {}
    for steps in (1, 3):
        with LLM(tiny, device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True, num_scheduler_steps=steps) as llm:
            assert llm.engine.executor.steps_per_launch == steps
            tokens[steps] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[3] == tokens[1]


def test_the_flags(capsys):
    """vLLM's --kv-cache-dtype (no longer refused) and --calculate-kv-scales, into EngineConfig."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config(parser.parse_args(["--model", "demo"]))
    assert (default.kv_cache_dtype, default.calculate_kv_scales) == ("auto", False)
    cfg = engine_config(parser.parse_args(["--model", "demo", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"]))
    assert (cfg.kv_cache_dtype, cfg.calculate_kv_scales) == ("fp8", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "demo", "--kv-cache-dtype", "fp8_e5m2"])
    assert "invalid choice: 'fp8_e5m2'" in capsys.readouterr().err


def test_the_static_step_over_an_fp8_cache_on_a_fake_h200():
    """DiffusionGemma 26B-A4B's widths cut to a sliding and a full layer, bfloat16, on a fake H200
    (tests/fake_cuda.py): the static step (what CUDA graphs capture) over an FP8 cache runs the
    Triton kernel's FP8 path with the scales on the device, with no host read and no device mismatch."""
    from fake_cuda import NoHostReads, fake_cuda, fake_module
    from helpers import new_requests, whole_tables

    from blockdiff.diffusion.entropy_bound import EntropyBound, denoise_params
    from blockdiff.model.attention_backends import triton_paged
    from blockdiff.model.diffusion_gemma import DiffusionGemma
    from blockdiff.model.registry import load_config
    from blockdiff.parallel.group import TPGroup
    from blockdiff.sampling_params import REFERENCE_DEFAULTS
    from blockdiff.worker.canvas_step import CanvasSteps
    from blockdiff.worker.model_runner import ModelRunner, RunnerSettings

    config = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "diffusiongemma-26b-a4b.json"))
    keep = (0, next(i for i, spec in enumerate(config.arch.layers) if not spec.sliding))
    config = replace(config, windows=tuple(config.windows[i] for i in keep),
                     arch=replace(config.arch, layers=tuple(config.arch.layers[i] for i in keep)))
    cache = CacheConfig(num_slots=4, num_blocks=256, block_size=16, max_model_len=2048, kv_cache_dtype="fp8")
    calls = []
    original = triton_paged.paged_attention

    def counted(q, k, v, k_cache, v_cache, table, tiles, bounds, block_size, k_scale=None, v_scale=None):
        calls.append((k_cache.dtype, k_scale.device, k_scale.dtype))
        return original(q, k, v, k_cache, v_cache, table, tiles, bounds, block_size, k_scale, v_scale)

    with fake_cuda((9, 0)), pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_paged, "paged_attention", counted)
        model = fake_module(lambda: DiffusionGemma(config, TPGroup(), torch.bfloat16)).eval()
        runner = ModelRunner(model, cache, "cuda", EntropyBound(), RunnerSettings(sampler_memory_gb=1.0))
        assert all(t.dtype == torch.float8_e4m3fn and t.is_cuda for kv in runner.kv for t in kv)
        steps = CanvasSteps(runner.model, runner.sampler, runner.vocab, runner.kv, runner.geometry,
                            runner.tables.tables, runner.state, runner.requests, runner.device, compile=False,
                            cuda_graphs=False)
        cl = runner.canvas_length
        rows = [Row(s, start, cl, True, tuple(range(64 * s, 64 * s + -(-start // 16)))) for s, start in ((0, 700), (1, 17))]
        resolved = [EntropyBound().resolve(SamplingParams(), REFERENCE_DEFAULTS)] * 2
        params = denoise_params([16] * 2, resolved, [0, 1])
        runner.tables.apply(whole_tables(rows))
        runner.requests.admit(new_requests(rows, [16] * 2, resolved, [0, 1]))
        with NoHostReads():
            steps(rows, params.options())
    assert calls == [(torch.float8_e4m3fn, torch.device("cuda", 0), torch.float32)] * 2


def test_the_triton_backend_reads_fp8_from_capability_8_9(monkeypatch):
    """Triton converts float8e4nv from Ada / Hopper on: with an FP8 cache "auto" keeps the reference
    on an A100, and asking for triton there is refused."""
    from blockdiff.model.attention_backends import choose_attention_backend

    for capability, auto in (((9, 0), "triton"), ((8, 9), "triton"), ((8, 0), "reference")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert choose_attention_backend("cuda", torch.bfloat16, fp8_cache=True) == auto
        assert choose_attention_backend("cuda", torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="capability 8.9"):
        choose_attention_backend("cuda", torch.bfloat16, "triton", fp8_cache=True)
