"""Integer weight-only checkpoints: compressed-tensors pack-quantized ones written through
compressed-tensors' own ModelCompressor (as llm-compressor saves them), and GPTQ ones packed in
GPTQModel's layout; loaded with no flag and run against transformers on the dequantized weights in
float32, on one rank and split over two; refused with one line naming what is not served."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from gptq_layout import write_gptq
from helpers import Harness, Oracle, rel_err
from int_oracle import decompressed, with_weights
from safetensors.torch import load_file, save_file
from test_parity import _tokens

from blockdiff.model.loader import load_model
from blockdiff.model.quantize import quantize_checkpoint
from blockdiff.model.quantize_int import IntWriter
from blockdiff.parallel.quantization.integer import IntExpertsMethod, IntLinearMethod

# Inner widths divisible by 32 (compressed-tensors writes whole groups only); the odd vocabulary and
# TP_SPEC's layer mix; o_proj's 96 columns split over two ranks cut a group of 32 in two.
GROUP_SPEC = dict(
    vocab_size=263, hidden_size=64, intermediate_size=128, num_layers=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_heads=12, num_kv_heads=6,
    head_dim=8, global_head_dim=16, num_global_kv_heads=1, num_experts=4, top_k_experts=2,
    moe_intermediate_size=64, sliding_window=7, canvas_length=8, seed=11,
)
# Every inner width a multiple of 128, for groups of 128.
WIDE_SPEC = {**GROUP_SPEC, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_heads": 8,
             "num_kv_heads": 4, "head_dim": 16, "global_head_dim": 32}
IGNORE = ["lm_head", "re:.*embed.*", "re:.*router.*", "re:.*vision.*", "re:.*self_conditioning.*"]
# Integer weights are dequantized exactly in float32 by both; what is left is summation order.
TOL = 1e-4


def _int(bits: int, strategy: str, group_size: int | None = None, symmetric: bool = True):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size)


def _config(*groups):
    """A QuantizationConfig of (targets, weights) config groups."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    schemes = {f"group_{i}": QuantizationScheme(targets=t, weights=w) for i, (t, w) in enumerate(groups)}
    return QuantizationConfig(config_groups=schemes, ignore=IGNORE, format="pack-quantized")


# name -> (tiny spec, the QuantizationConfig's config groups)
SCHEMES = {
    "int4-sym-g32": (GROUP_SPEC, [(["Linear"], ("4", "group", 32, True))]),
    "int4-asym-g32": (GROUP_SPEC, [(["Linear"], ("4", "group", 32, False))]),
    "int4-sym-g128": (WIDE_SPEC, [(["Linear"], ("4", "group", 128, True))]),
    "int4-asym-g128": (WIDE_SPEC, [(["Linear"], ("4", "group", 128, False))]),
    "int8-channel": ("tp", [(["Linear"], ("8", "channel", None, True))]),  # TP_SPEC's odd widths (48, 24)
    "int8-asym-g32": (GROUP_SPEC, [(["Linear"], ("8", "group", 32, False))]),
    "mixed": (GROUP_SPEC, [(["re:.*experts.*"], ("4", "group", 32, True)), (["Linear"], ("8", "channel", None, True))]),
}


@pytest.fixture(scope="module")
def spec_path(checkpoints):
    def path(spec) -> str:
        if spec == "tp":
            from helpers import import_test_file
            return checkpoints("tp", **import_test_file("parallel/test_tensor_parallel.py").TP_SPEC)
        return checkpoints("int_wide" if spec is WIDE_SPEC else "int_group", **spec)
    return path


@pytest.fixture(scope="module")
def written(spec_path, tmp_path_factory):
    """scheme name -> (source checkpoint, its pack-quantized checkpoint), each written once."""
    made = {}

    def make(name: str) -> tuple[str, str]:
        if name not in made:
            spec, groups = SCHEMES[name]
            src = spec_path(spec)
            config = _config(*[(t, _int(int(b), s, g, sym)) for t, (b, s, g, sym) in groups])
            made[name] = src, quantize_checkpoint(src, str(tmp_path_factory.mktemp(name) / "model"), IntWriter(config))
        return made[name]

    return make


def _logits(model, vocab: int) -> torch.Tensor:
    model.encode(_tokens(13, vocab, 0))
    return model.decode(_tokens(8, vocab, 1))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_logits_equal_transformers_on_the_dequantized_weights(written, name):
    src, path = written(name)
    vocab = GROUP_SPEC["vocab_size"]  # every spec's (TP_SPEC's too)
    model = load_model(path)
    layer = model.layers[0]
    assert isinstance(layer.attn.qkv_proj.method, IntLinearMethod) and isinstance(layer.experts.method, IntExpertsMethod)
    assert layer.router.proj.weight.dtype == model.embed.weight.dtype == torch.float32  # ignored: unquantized
    assert model.self_conditioning.mlp.gate_up_proj.weight.dtype == torch.float32
    ours = _logits(Harness(model), vocab)
    ref = _logits(Oracle(with_weights(src, decompressed(path))), vocab)
    full = _logits(Harness(load_model(src)), vocab)
    err, quant_err = rel_err(ours, ref), rel_err(ref, full)
    print(f"{name}: ours vs oracle {err:.2e}; oracle vs float32 model {quant_err:.2e}")
    assert err <= TOL
    assert quant_err > 10 * TOL  # the tolerance is far below what quantizing moves


def _greedy_equals_oracle_on_one_and_two_ranks(path: str, hf) -> None:
    from helpers import hf_generate_with_draft, import_test_file
    tp = import_test_file("parallel/test_tensor_parallel.py")
    from blockdiff import LLM

    params = [tp._greedy(d) for d in tp.DRAFTS]
    with LLM(path) as llm:
        one = [o.token_ids for o in llm.generate(tp.PROMPTS, params, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2) as llm:
        two = [o.token_ids for o in llm.generate(tp.PROMPTS, params, use_tqdm=False)]
    assert one == two
    eos = set(hf.generation_config.eos_token_id)
    for prompt, draft, ours in zip(tp.PROMPTS, tp.DRAFTS, one):
        theirs = hf_generate_with_draft(hf, prompt, draft, max_new_tokens=22, max_denoising_steps=4, **tp.GREEDY)
        cut = next((i + 1 for i, t in enumerate(theirs) if t in eos), 22)
        assert ours == theirs[:cut]


@pytest.mark.slow
@pytest.mark.usefixtures("single_threaded_workers")
@pytest.mark.parametrize("name", ["int4-asym-g32", "int4-sym-g128", "int8-channel", "mixed"])
def test_greedy_generation_equals_oracle_and_tp2(written, name):
    src, path = written(name)
    _greedy_equals_oracle_on_one_and_two_ranks(path, with_weights(src, decompressed(path)))


GPTQ = {"gptq-int4-g32": (4, 32, True, False), "gptq-int4-g32-desc-act": (4, 32, False, True),
        "gptq-int8-g32-desc-act": (8, 32, True, True)}


@pytest.fixture(scope="module")
def gptq(spec_path, tmp_path_factory):
    made = {}

    def make(name: str):
        if name not in made:
            src = spec_path(GROUP_SPEC)
            path = str(tmp_path_factory.mktemp(name) / "model")
            made[name] = src, path, write_gptq(src, path, *GPTQ[name])
        return made[name]

    return make


@pytest.mark.parametrize("name", list(GPTQ))
def test_gptq_logits_equal_transformers_on_the_dequantized_weights(gptq, name):
    src, path, weights = gptq(name)
    model = load_model(path)
    assert isinstance(model.layers[1].experts.method, IntExpertsMethod)
    assert model.layers[0].router.proj.weight.dtype == torch.float32
    vocab = GROUP_SPEC["vocab_size"]
    ours = _logits(Harness(model), vocab)
    ref = _logits(Oracle(with_weights(src, weights)), vocab)
    full = _logits(Harness(load_model(src)), vocab)
    err, quant_err = rel_err(ours, ref), rel_err(ref, full)
    print(f"{name}: ours vs oracle {err:.2e}; oracle vs float32 model {quant_err:.2e}")
    assert err <= TOL
    assert quant_err > 10 * TOL


@pytest.mark.slow
@pytest.mark.usefixtures("single_threaded_workers")
@pytest.mark.parametrize("name", ["gptq-int4-g32-desc-act"])
def test_gptq_greedy_generation_equals_oracle_and_tp2(gptq, name):
    src, path, weights = gptq(name)
    _greedy_equals_oracle_on_one_and_two_ranks(path, with_weights(src, weights))


def _edited(path: str, dst, config_edit=None, tensors_edit=None) -> str:
    shutil.copytree(path, dst)
    if config_edit:
        with open(os.path.join(dst, "config.json")) as f:
            config = json.load(f)
        config_edit(config["quantization_config"])
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f)
    if tensors_edit:
        file = os.path.join(dst, "model.safetensors")
        tensors = load_file(file)
        tensors_edit(tensors)
        save_file(tensors, file)
    return str(dst)


def _weights(q):
    return q["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: _weights(q).update(num_bits=3), "unsupported integer width 3"),
        (lambda q: _weights(q).update(strategy="tensor"), "unsupported integer weight strategy 'tensor'"),
        (lambda q: _weights(q).update(actorder="group"), "unsupported activation ordering 'group'"),
        (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int", "strategy": "token",
                                                                           "dynamic": True}),
         "unsupported input activation quantization 'int' 8-bit"),
        (lambda q: q.update(format="marlin-24"), "unsupported compressed-tensors format 'marlin-24'"),
        (lambda q: q.update(ignore=["lm_head", "re:.*embed.*", "re:.*self_conditioning.*"]), "quantizes the router"),
        (lambda q: q.update(ignore=IGNORE + ["re:.*k_proj"]), "differently"),
    ],
)
def test_unserved_integer_schemes_are_named(written, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_model(_edited(written("int4-asym-g32")[1], tmp_path / "bad", config_edit=edit))


Q = "model.decoder.layers.2.self_attn.o_proj"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop(f"{Q}.weight_zero_point"), r"missing from checkpoint .*layers\.2\.attn\.o_proj\.weight_zero_point"),
        (lambda t: t.update({f"{Q}.weight_scale": t[f"{Q}.weight_scale"][:, :1].contiguous()}), rf"'{Q}.weight_scale' has shape"),
        (lambda t: t.update({f"{Q}.weight_shape": torch.tensor([64, 95])}), r"says the weight is \[64, 95\]"),
        (lambda t: t.update({f"{Q}.weight_packed": t[f"{Q}.weight_packed"].float()}), r"is F32, but pack-quantized"),
    ],
)
def test_bad_integer_tensors_are_named(written, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_model(_edited(written("int4-asym-g32")[1], tmp_path / "bad", tensors_edit=edit))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: q.update(bits=2), "GPTQ: unsupported integer width 2"),
        (lambda q: q.update(checkpoint_format="marlin"), "unsupported GPTQ checkpoint_format 'marlin'"),
        (lambda q: q.update(lm_head=True), "GPTQ quantizes the LM head"),
    ],
)
def test_unserved_gptq_configs_are_named(gptq, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_model(_edited(gptq("gptq-int4-g32")[1], tmp_path / "bad", config_edit=edit))


@pytest.mark.parametrize("scheme, bits", [("w8a16", (8, 8)), ("w4a16", (4, 4)), ("mixed", (8, 4))])
def test_cli_schemes_round_trip_through_compressed_tensors(spec_path, tmp_path, scheme, bits):
    """`blockdiff quantize --scheme` writes what compressed-tensors decompresses to the source weights
    within half a quantization step, and blockdiff loads the same weights from it."""
    from blockdiff.entrypoints.cli import main as cli
    from blockdiff.ops.intmm import dequantize

    src, dst = spec_path(GROUP_SPEC), str(tmp_path / scheme)
    assert cli(["quantize", "--scheme", scheme, "--group-size", "32", src, dst]) == 0
    theirs, tensors, source = decompressed(dst), load_file(os.path.join(dst, "model.safetensors")), load_file(os.path.join(src, "model.safetensors"))
    layer = "model.decoder.layers.0"
    assert f"{layer}.router.proj.weight" in tensors and "model.decoder.embed_tokens.weight" in tensors
    for name, w in theirs.items():
        if ".experts." in name:
            e, proj = name.split(".")[-2:]
            fused = source[name.rsplit(".", 2)[0] + (".down_proj" if proj == "down_proj" else ".gate_up_proj")][int(e)]
            original = fused if proj == "down_proj" else fused.chunk(2)[proj == "up_proj"]
        else:
            original = source[name + ".weight"]
        scale = tensors[name + ".weight_scale"]
        step = scale.repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
        assert (w - original).abs().le(step / 2 * (1 + 1e-5) + 1e-7).all(), name
    model = load_model(dst)
    qkv, experts = model.layers[0].attn.qkv_proj, model.layers[0].experts
    assert (qkv.method.tensors.scheme.bits, experts.method.tensors.scheme.bits) == bits
    ours = dequantize(qkv.weight_packed, qkv.weight_scale, None, qkv.group_index)
    torch.testing.assert_close(ours, torch.cat([theirs[f"{layer}.self_attn.{p}_proj"] for p in "qkv"]), rtol=0, atol=0)
    gate_up = dequantize(experts.gate_up_packed[1], experts.gate_up_scale[1], None, experts.gate_up_group_index)
    w = GROUP_SPEC["moe_intermediate_size"]
    torch.testing.assert_close(gate_up[:w], theirs[f"{layer}.experts.1.gate_proj"], rtol=0, atol=0)
    torch.testing.assert_close(gate_up[w:], theirs[f"{layer}.experts.1.up_proj"], rtol=0, atol=0)
    assert torch.isfinite(_logits(Harness(model), GROUP_SPEC["vocab_size"])).all()


def test_cli_names_a_width_the_group_size_does_not_divide(spec_path, tmp_path, capsys):
    from blockdiff.entrypoints.cli import main as cli

    assert cli(["quantize", "--scheme", "w4a16", spec_path(GROUP_SPEC), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not a multiple of the group size 128" in err[0]


def test_lora_on_integer_layers_is_refused_naming_the_layer(written):
    """Adapters add a float delta to a float weight; an integer layer has none, so --enable-lora on an
    integer checkpoint is refused at load, naming the first layer it would have swapped."""
    from blockdiff.model.lora_layers import enable_lora
    from blockdiff.model.lora import LoRAError

    _, path = written("int8-channel")
    model = load_model(path)
    with pytest.raises(LoRAError, match=r"LoRA on a quantized layer \(.*: integer weights\) is not supported"):
        enable_lora(model, 2, 8)
