"""LoRA adapters (model/lora.py) against PEFT's unmerged model on transformers' DiffusionGemma (the oracle)."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from helpers import DEVICE, Harness, Oracle, load_hf, rel_err
from safetensors.torch import load_file, save_file

from blockdiff.model.attention import build_metadata
from blockdiff.model.interface import layer_kinds
from blockdiff.model.loader import load_model
from blockdiff.model.lora import AdapterCache, LoRAError, lora_pools, put_adapter, read_adapter
from blockdiff.model.lora_layers import LoRABatch, enable_lora
from blockdiff.model.attention import Row

peft = pytest.importorskip("peft")

FP32_TOL = 1e-4
# transformers' text modules that PEFT wraps (the vision tower's ClippableLinear is not a plain Linear)
ATTN_MLP = (r".*model\.(?:encoder\.language_model|decoder)\.(?:layers\.\d+\.(?:self_attn|mlp)\.(?:q|k|v|o|gate|up|down)_proj"
            r"|self_conditioning\.(?:gate|up|down)_proj)")


def make_adapter(base: str, out: str, seed: int, r: int = 4, alpha: int = 8, target: str = ATTN_MLP, **kw) -> str:
    """PEFT puts a random LoRA (init_lora_weights=False) on transformers' model of `base` and saves it."""
    if not os.path.isdir(out):
        torch.manual_seed(seed)
        hf = load_hf(base)
        cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=target, init_lora_weights=False, **kw)
        model = peft.get_peft_model(hf, cfg)
        # scale B up so that the delta matters against the tiny random weights
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(4)
        model.save_pretrained(out)
    return out


# ---- adapter files damaged as a disk or a hostile client might (tests/server/test_server_lora_identity.py too)

WEIGHTS = "adapter_model.safetensors"


def wrong_shapes(path: str) -> None:
    tensors = load_file(os.path.join(path, WEIGHTS))
    save_file({k: torch.randn(t.shape[0], t.shape[1] + 8) for k, t in tensors.items()}, os.path.join(path, WEIGHTS))


def truncated(path: str) -> None:
    with open(os.path.join(path, WEIGHTS), "rb") as f:
        data = f.read()
    with open(os.path.join(path, WEIGHTS), "wb") as f:
        f.write(data[: len(data) // 2])


def zero_rank(path: str) -> None:
    tensors = load_file(os.path.join(path, WEIGHTS))
    save_file({k: t[:0] if ".lora_A." in k else t[:, :0] for k, t in tensors.items()}, os.path.join(path, WEIGHTS))


def huge_header(path: str) -> None:
    """A few hundred bytes whose header claims a 100,000 x 250,000 tensor."""
    header = json.dumps({"base_model.model.model.decoder.layers.0.self_attn.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [100_000, 250_000], "data_offsets": [0, 100_000 * 250_000 * 4]}}).encode()
    with open(os.path.join(path, WEIGHTS), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)


def config_not_json(path: str) -> None:
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write("{not json")


def peft_model(base: str, adapter: str):
    return peft.PeftModel.from_pretrained(load_hf(base), adapter).eval()


class LoRAHarness(Harness):
    """Harness whose tokens all use adapter slot `slot`, set on the LoRA layers' mapping before each forward."""

    def __init__(self, model, slot: int):
        super().__init__(model)
        self.slot = slot
        self.mapping = model.layers[0].attn.qkv_proj.mapping

    @torch.no_grad()
    def encode(self, ids):
        row = Row(0, self.length, len(ids), False, self.blocks)
        meta = build_metadata([row], self.geo, layer_kinds(self.model), DEVICE)
        ids_t = torch.tensor(ids + [0] * (meta.num_tokens - len(ids)), device=DEVICE)
        self.mapping.set(self.index(len(ids)), meta, experts=True)
        self.model(ids_t, meta, self.kv)
        self.length += len(ids)

    def index(self, n):
        return torch.full((n,), self.slot, dtype=torch.long, device=DEVICE)

    @torch.no_grad()
    def decode(self, canvas, soft=None):
        meta = build_metadata([Row(0, self.length, len(canvas), True, self.blocks)], self.geo, layer_kinds(self.model), DEVICE)
        ids_t = torch.tensor(canvas + [0] * (meta.num_tokens - len(canvas)), device=DEVICE)
        self.mapping.set(self.index(len(canvas)), meta, experts=True)
        return self.model(ids_t, meta, self.kv, soft)


def _tokens(n, vocab, seed):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    return make_adapter(tiny, str(tmp_path_factory.mktemp("lora") / "a"), seed=0)


def test_forward_parity_with_peft(tiny, adapter):
    """Prefill (encoder mode), a committed canvas and a denoising step (decoder mode) with
    self-conditioning: our logits are PEFT's unmerged model's."""
    model = load_model(tiny, dtype=torch.float32, device=DEVICE)
    enable_lora(model, 2, 8)
    put_adapter(model, 1, read_adapter(adapter))
    mine, ref = LoRAHarness(model, 1), Oracle(peft_model(tiny, adapter).base_model.model)
    base = Oracle(load_hf(tiny))
    prompt, first, canvas = _tokens(5, 301, 0), _tokens(8, 301, 1), _tokens(8, 301, 2)
    for side in (mine, ref, base):
        side.encode(prompt)
        side.encode(first)
    sc = (torch.randn(8, 301, generator=torch.Generator().manual_seed(4)) * 3).to(DEVICE)
    from blockdiff.parallel.self_conditioning import soft_embedding
    soft = soft_embedding(sc.softmax(-1), model.embed.weight, model.embed_scale)
    want = ref.decode(canvas, sc)
    assert rel_err(mine.decode(canvas, soft), want) <= FP32_TOL
    assert rel_err(base.decode(canvas, sc), want) > 100 * FP32_TOL  # the adapter matters


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


@pytest.mark.parametrize("targets", [EXPERTS, EXPERTS[1:], EXPERTS[:1]], ids=["both", "down", "gate_up"])
def test_expert_adapters_match_peft(tiny, tmp_path, targets):
    """An adapter on the experts' 3-D tensors (PEFT's target_parameters; both nested on one module,
    or one alone): our logits are PEFT's, and without the experts' deltas they are not."""
    target = ATTN_MLP if len(targets) == 2 else r".*model\.decoder\.layers\.0\.self_attn\.q_proj"
    path = make_adapter(tiny, str(tmp_path / "experts"), seed=3, target=target, target_parameters=targets)
    adapter = read_adapter(path)
    assert {key[2] for _, key, _ in adapter.deltas if key[1] == "experts"} == {t.split(".")[1] for t in targets}
    ref = Oracle(peft_model(tiny, path).base_model.model)
    without = read_adapter(path)
    without.deltas = {k: v for k, v in without.deltas.items() if k[1][1] != "experts"}
    sides = []
    for a in (adapter, without):
        model = load_model(tiny, dtype=torch.float32, device=DEVICE)
        enable_lora(model, 2, 8)
        put_adapter(model, 1, a)
        sides.append(LoRAHarness(model, 1))
    prompt, first, canvas = _tokens(5, 301, 0), _tokens(8, 301, 1), _tokens(8, 301, 2)
    for side in (*sides, ref):
        side.encode(prompt)
        side.encode(first)
    want = ref.decode(canvas)
    assert rel_err(sides[0].decode(canvas), want) <= FP32_TOL
    assert rel_err(sides[1].decode(canvas), want) > 100 * FP32_TOL  # the experts' deltas matter


def test_expert_adapters_where_the_batched_kernel_is_chosen(tiny, tmp_path, monkeypatch):
    """On a CPU whose experts run batched (AMX; forced here, on any CPU), a step whose adapters may
    target the experts takes the grouped products and their LoRA pools: still PEFT's logits, and
    the batched path is never tried; a step without adapters tries it."""
    import blockdiff.model.moe as moe
    from blockdiff.ops.kernels import BATCHED

    monkeypatch.setattr(moe, "kernel_on", lambda *a: BATCHED)
    batched = []
    original = moe.Experts._batched
    monkeypatch.setattr(moe.Experts, "_batched", lambda self, *a: batched.append(1) or original(self, *a))
    test_expert_adapters_match_peft(tiny, tmp_path, EXPERTS)
    assert not batched
    model = load_model(tiny, dtype=torch.float32, device=DEVICE)
    Harness(model).encode(_tokens(9, 301, 4))
    assert batched


def test_expert_deltas_alike_on_the_grouped_and_the_per_expert_products(tiny, tmp_path):
    """The experts' LoRA through the grouped product (the CPU's and Hopper's) and through the
    per-expert one (other GPUs): the same rows, within float32 rounding."""
    from blockdiff.model.moe import Experts

    path = make_adapter(tiny, str(tmp_path / "experts"), seed=5, target=r".*model\.decoder\.layers\.0\.self_attn\.q_proj",
                        target_parameters=EXPERTS)
    model = load_model(tiny, dtype=torch.float32, device=DEVICE)
    enable_lora(model, 3, 8)
    put_adapter(model, 2, read_adapter(path))
    experts: Experts = model.layers[0].experts
    g = torch.Generator().manual_seed(0)
    sizes = [8, 0, 16, 8]  # rows per expert, aligned; expert 1 idle
    xs = torch.randn(sum(sizes), experts.hidden_in, generator=g)
    batch = LoRABatch(torch.tensor([2, -1, 2, 0, 2, 2, -1, 2, 2, 2]), 4, experts=True)
    source = torch.randint(0, 10, (sum(sizes),), generator=g)
    mask = experts.lora_gate_up.mask(batch, source)
    assert mask.sum() == 8 * (batch.index[source] >= 0).sum()  # rank 8: each row with an adapter keeps 8 columns
    ends = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    grouped, per_expert = experts._grouped(xs, ends, experts.deltas(mask)), experts._per_expert(xs, sizes, experts.deltas(mask))
    assert torch.allclose(grouped, per_expert, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(grouped, experts._grouped(xs, ends), atol=1e-3)  # the deltas are there


def test_no_adapter_rows_are_the_base_model(tiny, adapter):
    """Tokens of slot -1 in a model with a pool (an adapter loaded in another slot) get the base
    model's logits, bit for bit."""
    model = load_model(tiny, dtype=torch.float32, device=DEVICE)
    plain = Harness(load_model(tiny, dtype=torch.float32, device=DEVICE))
    enable_lora(model, 2, 8)
    put_adapter(model, 0, read_adapter(adapter))
    mine = LoRAHarness(model, -1)
    prompt, canvas = _tokens(5, 301, 0), _tokens(8, 301, 2)
    mine.encode(prompt)
    plain.encode(prompt)
    assert torch.equal(mine.decode(canvas), plain.decode(canvas))


def test_unsupported_targets_fail_at_load(tiny, tmp_path):
    path = make_adapter(tiny, str(tmp_path / "router"), seed=1, target=r".*model\.decoder\.layers\.0\.router\.proj")
    with pytest.raises(LoRAError, match=r"model\.decoder\.layers\.0\.router\.proj"):
        read_adapter(path)
    path = make_adapter(tiny, str(tmp_path / "experts"), seed=1, target=r".*model\.decoder\.layers\.0\.self_attn\.q_proj",
                        target_parameters=["experts.gate_up_proj"])
    config = os.path.join(path, "adapter_config.json")
    cfg = json.load(open(config))
    for targets, match in ((["router.per_expert_scale"], "target_parameters"),
                           (None, r"layers\.\d\.experts, which blockdiff cannot apply")):  # the tensors name them
        json.dump({**cfg, "target_parameters": targets}, open(config, "w"))
        with pytest.raises(LoRAError, match=match):
            read_adapter(path)
    model = load_model(tiny, dtype=torch.float32, device=DEVICE)
    enable_lora(model, 1, 2)
    with pytest.raises(LoRAError, match="max-lora-rank"):
        put_adapter(model, 0, read_adapter(make_adapter(tiny, str(tmp_path / "r4"), seed=2)))


@pytest.mark.parametrize("damage, reason", [(truncated, "cannot be read"), (huge_header, "cannot be read"),
                                            (zero_rank, "rank 0"), (config_not_json, "not JSON")])
def test_malformed_adapters_are_lora_errors(adapter, tmp_path, damage, reason):
    """Whatever is wrong with the files, reading them says so as a LoRAError (a 400 on the server)."""
    path = shutil.copytree(adapter, tmp_path / "damaged")
    damage(path)
    with pytest.raises(LoRAError, match=reason):
        read_adapter(str(path))


def test_an_adapter_that_does_not_fit_leaves_its_slot_empty(tiny, adapter):
    """Every delta is checked before the first is written: a slot never holds part of an adapter
    (nor, after a failed load, the adapter it held before)."""
    model = load_model(tiny, dtype=torch.float32, device=DEVICE)
    enable_lora(model, 2, 8)
    put_adapter(model, 0, read_adapter(adapter))
    bad = read_adapter(adapter)
    last = list(bad.deltas)[-1]  # the delta written last
    a, b, scale, name = bad.deltas[last]
    bad.deltas[last] = (a, b[:-1], scale, name)
    with pytest.raises(LoRAError, match="do not fit"):
        put_adapter(model, 0, bad)
    assert not any(buf.any() for pool in lora_pools(model).values() for buf in (pool.a, pool.b))


def test_the_host_cache_reads_only_the_files_it_was_asked_for(tiny, tmp_path):
    """An adapter evicted from host memory and read again must come from files of the fingerprint
    the engine recorded: files rewritten since are a LoRAError, never other weights."""
    a, b = (make_adapter(tiny, str(tmp_path / name), seed=seed) for name, seed in (("a", 5), ("b", 6)))
    cache = AdapterCache(1)
    first = cache.get(a)
    assert cache.get(a, first.fingerprint) is first
    cache.get(b)  # a is evicted
    shutil.copyfile(os.path.join(b, WEIGHTS), os.path.join(a, WEIGHTS))
    with pytest.raises(LoRAError, match="changed on disk"):
        cache.get(a, first.fingerprint)
    assert cache.get(a).fingerprint != first.fingerprint  # as the files are now, when no fingerprint is asked for


# ---- through the engine ----------------------------------------------------------------------------

GREEDY = dict(t_min=1e-6, t_max=2e-6)
MAX_TOKENS, STEPS = 16, 4


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """Three adapters: attention + MLP (+ self-conditioning) of ranks 4, 8 and 2, one with rsLoRA,
    the first on the experts too."""
    root = tmp_path_factory.mktemp("loras")
    return [make_adapter(tiny, str(root / "a0"), seed=10, r=4, target_parameters=EXPERTS),
            make_adapter(tiny, str(root / "a1"), seed=11, r=8, alpha=4, use_rslora=True),
            make_adapter(tiny, str(root / "a2"), seed=12, r=2, alpha=16)]


def _requests(paths):
    from blockdiff import LoRARequest
    return [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(paths)]


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_generation_matches_peft(tiny, adapters, tp):
    """blockdiff serving PEFT adapters (one on attention, MLPs and experts, one on attention and MLPs
    with rsLoRA) generates transformers' greedy tokens through PEFT's unmerged model, on one rank and
    on two (A and B sharded as their layers, the experts' by their width)."""
    from helpers import hf_generate_with_draft

    from blockdiff import LLM, SamplingParams

    prompts = [_tokens(n, 301, 100 + n) for n in (3, 11)]
    drafts = [_tokens(MAX_TOKENS, 301, 200 + n) for n in (3, 11)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, max_denoising_steps=STEPS, draft=d, ignore_eos=True, **GREEDY)
              for d in drafts]
    loras = _requests(adapters[:2])
    with LLM(tiny, device="cpu", tensor_parallel_size=tp, enable_lora=True, max_lora_rank=8) as llm:
        got = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]
               for lora in loras]
    base = load_hf(tiny)
    for path, tokens in zip(adapters, got):
        hf = peft_model(tiny, path).base_model.model
        for prompt, draft, mine in zip(prompts, drafts, tokens):
            want = hf_generate_with_draft(hf, prompt, draft, max_new_tokens=MAX_TOKENS, max_denoising_steps=STEPS, **GREEDY)
            assert list(mine) == want[:MAX_TOKENS]
            plain = hf_generate_with_draft(base, prompt, draft, max_new_tokens=MAX_TOKENS, max_denoising_steps=STEPS,
                                           **GREEDY)
            assert plain != want  # the adapter changes the tokens


def test_mixed_batch_is_each_request_alone(tiny, adapters):
    """One batch of three adapters (one on the experts) and the base model: each request's tokens are
    those it gets alone (bit-identical; seeded sampling), and the pool of 2 slots makes the third
    adapter wait, not fail."""
    from blockdiff import LLM, SamplingParams

    loras = [*_requests(adapters), None, _requests(adapters)[0]]
    prompts = [_tokens(n, 301, 300 + n) for n in (4, 9, 6, 13, 7)]
    params = SamplingParams(max_tokens=MAX_TOKENS, max_denoising_steps=STEPS, seed=5, ignore_eos=True)
    with LLM(tiny, device="cpu", enable_lora=True, max_loras=3, max_lora_rank=8, max_num_seqs=8) as llm:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]
        alone = [llm.generate([p], params, use_tqdm=False, lora_request=[lo])[0].outputs[0].token_ids
                 for p, lo in zip(prompts, loras)]
        assert len(set(map(tuple, alone))) == len(alone)  # every adapter gives other tokens
        # the static step ran at every LoRA level (its shape key ends with StepAdapters.level:
        # 0 no adapter, 1 adapters, 2 one of them on the experts)
        levels = {key[-1] for key in llm.engine.executor.runner.canvas_steps.shapes}
        assert levels == {0, 1, 2}
    assert together == alone
    with LLM(tiny, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8) as llm:
        cycled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]
        assert cycled == alone
        assert len(llm.engine.lora.held) == 2


def test_fast_mode_with_adapters_is_each_request_alone(tiny, adapters):
    """The fast denoising mode runs only a canvas's unsettled rows, so the adapter mapping covers
    only those: in one batch of fast requests with two adapters (one on the experts) and the base
    model, each gets the tokens it gets alone, and the steps ran fewer rows than the canvases hold."""
    from blockdiff import LLM, SamplingParams

    loras = [*_requests(adapters[:2]), None]
    prompts = [_tokens(n, 301, 400 + n) for n in (5, 8, 11)]
    params = SamplingParams(max_tokens=MAX_TOKENS, max_denoising_steps=8, seed=3, ignore_eos=True, t_min=0.1,
                            t_max=0.2, confidence_threshold=0.0, denoising_mode="fast", settle_steps=1,
                            settle_entropy=100.0)
    with LLM(tiny, device="cpu", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8) as llm:
        together = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        alone = [llm.generate([p], params, use_tqdm=False, lora_request=[lo])[0].outputs[0].token_ids
                 for p, lo in zip(prompts, loras)]
    assert len(set(map(tuple, alone))) == len(alone)
    assert [o.outputs[0].token_ids for o in together] == alone
    evaluated = sum(o.metrics["canvas_positions_evaluated"] for o in together)
    steps = sum(o.metrics["denoising_steps"] for o in together)
    assert 0 < evaluated < steps * 8  # settled positions were not run again (8: the tiny canvas)


@pytest.mark.slow  # two replica processes of their own: ~20 s on a busy 2-core machine
def test_data_parallel_replicas_serve_adapters(tiny, adapters):
    """LLM(data_parallel_size=2) routes each prompt with its adapter to a replica: the tokens of one engine."""
    from blockdiff import LLM, SamplingParams

    loras = [*_requests(adapters[:2]), None, _requests(adapters[:1])[0]]
    prompts = [_tokens(n, 301, 400 + n) for n in (4, 9, 6, 5)]
    params = SamplingParams(max_tokens=MAX_TOKENS, max_denoising_steps=STEPS, seed=5, ignore_eos=True)
    with LLM(tiny, enable_lora=True, max_lora_rank=8) as one:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False, lora_request=loras)]
    with LLM(tiny, enable_lora=True, max_lora_rank=8, data_parallel_size=2) as two:
        assert two.engine is None
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False, lora_request=loras)]
    assert got == expected
    assert len({tuple(t) for t in got[:3]}) == 3  # the adapters matter


def test_prefix_cache_keys_include_the_adapter(tiny, adapters):
    """An adapter's cached prefix is found by that adapter only, and gives the bits the adapter
    computes without it: the uncached tail (43 - 40 tokens) leads a step with a row count off the
    8-row groups in which the CPU's products are batch-invariant (the logprobs show any bit)."""
    from blockdiff import LLM, SamplingParams

    prompt = _tokens(43, 301, 7)
    params = SamplingParams(max_tokens=8, max_denoising_steps=STEPS, seed=1, ignore_eos=True, logprobs=0)
    a, b = _requests(adapters[:2])
    with LLM(tiny, device="cpu", enable_lora=True, max_lora_rank=8, enable_prefix_caching=True, block_size=8) as llm:
        first = llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0]
        other = llm.generate([prompt], params, use_tqdm=False, lora_request=b)[0]
        again = llm.generate([prompt], params, use_tqdm=False, lora_request=a)[0]
    assert not other.num_cached_tokens
    assert again.num_cached_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].logprobs == first.outputs[0].logprobs


def test_pool_holds_at_most_max_loras(tiny, adapters, tmp_path_factory):
    """Cycling five adapters through two device slots (two kept in host memory): no error, each
    request its tokens alone, and neither the device pool nor the host cache grows."""
    from blockdiff import LLM, LoRARequest, SamplingParams

    root = tmp_path_factory.mktemp("cycle")
    paths = adapters + [make_adapter(tiny, str(root / f"c{i}"), seed=30 + i, r=4) for i in range(2)]
    loras = [LoRARequest(f"c{i}", i + 1, p) for i, p in enumerate(paths)]
    params = SamplingParams(max_tokens=8, max_denoising_steps=STEPS, seed=2, ignore_eos=True)
    prompt = _tokens(6, 301, 9)
    with LLM(tiny, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8) as llm:
        runner = llm.engine.executor.runner
        pools = [m for m in runner.model.modules() if type(m).__name__ in ("LoRALinear", "LoRAExperts")]
        size = sum(b.numel() for m in pools for b in m.buffers())
        first = [llm.generate([prompt], params, use_tqdm=False, lora_request=lo)[0].outputs[0].token_ids for lo in loras]
        again = [llm.generate([prompt], params, use_tqdm=False, lora_request=lo)[0].outputs[0].token_ids
                 for lo in reversed(loras)]
        batch = [o.outputs[0].token_ids for o in llm.generate([prompt] * 5, params, use_tqdm=False, lora_request=loras)]
        assert sum(b.numel() for m in pools for b in m.buffers()) == size
        assert len(runner.lora.cache.entries) <= 2
        assert len(llm.engine.lora.held) == 2 and sum(llm.engine.lora.refs) == 0
    assert again[::-1] == first == batch
    assert len(set(map(tuple, first))) == len(first)


def test_lora_flags_and_misuse(tiny, adapters):
    import argparse

    from blockdiff import LLM, LoRARequest
    from blockdiff.arg_utils import add_engine_args, engine_config
    from blockdiff.engine.lora_request import lora_modules

    assert lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == [
        LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y", "m")]
    with pytest.raises(ValueError, match="name=path"):
        lora_modules(["nopath"])
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--model", tiny, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                                      "--max-cpu-loras", "5", "--lora-modules", "a=/x", "b=/y"]))
    assert (cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, cfg.lora_modules) == (
        True, 3, 32, 5, ("a=/x", "b=/y"))
    with pytest.raises(ValueError, match="--enable-lora"):
        engine_config(p.parse_args(["--model", tiny, "--lora-modules", "a=/x"]))
    with LLM(tiny, device="cpu") as llm:  # without --enable-lora a request cannot name an adapter
        with pytest.raises(ValueError, match="enable-lora"):
            llm.generate([[5, 6]], lora_request=LoRARequest("a", 1, adapters[0]), use_tqdm=False)
    with LLM(tiny, device="cpu", enable_lora=True, max_lora_rank=2) as llm:  # rank 4 > --max-lora-rank 2
        with pytest.raises(LoRAError, match="max-lora-rank"):
            llm.generate([[5, 6]], lora_request=LoRARequest("a", 1, adapters[0]), use_tqdm=False)


@pytest.mark.slow  # transformers and PEFT make an adapter of a second checkpoint: 13 s on a quiet 2-core AVX2 machine
def test_an_adapter_of_another_model_is_refused_when_named(tiny, checkpoints, tmp_path):
    """Checked against the model when a request names it: no step ever meets it."""
    from blockdiff import LLM, LoRARequest

    other = checkpoints("lora_other", vocab_size=301, canvas_length=8, num_layers=5, num_heads=4, num_kv_heads=2,
                        head_dim=16, global_head_dim=32, num_global_kv_heads=1, seed=3)
    path = make_adapter(other, str(tmp_path / "other"), seed=40)
    with LLM(tiny, device="cpu", enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(LoRAError, match="do not fit the model|layers"):
            llm.generate([[5, 6]], lora_request=LoRARequest("o", 1, path), use_tqdm=False)
        assert llm.generate([[5, 6]], use_tqdm=False)[0].outputs[0].token_ids  # the engine goes on


def test_the_runner_swaps_in_the_lora_layers_only_with_lora(tiny, adapters):
    """With --enable-lora the runner replaces every layer an adapter may target by its LoRA layer
    (holding the base layer), and those are what runs: a step with an adapter runs every pool, a step
    without runs none. Without --enable-lora the model keeps its plain layers."""
    from blockdiff import LLM, SamplingParams
    from blockdiff.model.lora_layers import LORA_LAYERS

    twins = tuple(LORA_LAYERS.values())
    params = SamplingParams(max_tokens=8, max_denoising_steps=STEPS, seed=2, ignore_eos=True)
    prompt = _tokens(6, 301, 9)
    with LLM(tiny, device="cpu") as llm:
        model = llm.engine.executor.runner.model
        assert not any(isinstance(m, twins) for m in model.modules())
        plain = {name: type(m) for name, m in model.named_modules() if type(m) in LORA_LAYERS}
    with LLM(tiny, device="cpu", enable_lora=True, max_lora_rank=8) as llm:
        model = llm.engine.executor.runner.model
        swapped = {name: m for name, m in model.named_modules() if isinstance(m, twins)}
        targets = {f"layers.{i}.{p}" for i in range(len(model.layers))
                   for p in ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "experts")}
        assert set(swapped) == targets | {"self_conditioning.mlp.gate_up_proj", "self_conditioning.mlp.down_proj"}
        for name, layer in swapped.items():
            assert type(layer) is LORA_LAYERS[plain[name]] and type(layer.base_layer) is plain[name]
        runs = []
        pools = [p for m in swapped.values() for p in m.children() if not isinstance(p, tuple(LORA_LAYERS))]
        for pool in pools:
            pool.register_forward_hook(lambda module, args, out: runs.append(module))
        llm.generate([prompt], params, use_tqdm=False, lora_request=_requests(adapters[:1])[0])
        assert {id(p) for p in runs} == {id(p) for p in pools}  # adapters[0] targets the experts too
        runs.clear()
        llm.generate([prompt], params, use_tqdm=False)
        assert not runs


@pytest.mark.slow  # two engines and a dynamo trace of the static step: ~40 s on a 2-core machine
def test_the_traced_step_runs_the_adapters_as_the_eager_one(tiny, adapters):
    """The static step traced whole (fullgraph=True, dynamo's graph-only backend) sets the LoRA
    layers' mapping inside the traced function: a batch of an adapter on the experts and the base
    model gives the eager step's tokens."""
    from blockdiff import LLM, SamplingParams
    from blockdiff.worker.canvas_step import canvas_step

    params = SamplingParams(max_tokens=16, max_denoising_steps=STEPS, seed=2, ignore_eos=True)
    prompts, loras = [_tokens(7, 301, 5)] * 2, [_requests(adapters[:1])[0], None]
    got, graphs = [], []
    for traced in (False, True):
        with LLM(tiny, device="cpu", enable_lora=True, max_lora_rank=8, compile=traced) as llm:
            if traced:
                def backend(gm, example_inputs):
                    graphs.append(gm)
                    return gm.forward

                llm.engine.executor.runner.canvas_steps.fn = torch.compile(canvas_step, fullgraph=True, backend=backend)
            got.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)])
    assert graphs and got[0] == got[1] and got[0][0] != got[0][1]
