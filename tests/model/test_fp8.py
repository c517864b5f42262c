"""FP8 checkpoints (compressed-tensors float-quantized): made by `blockdiff quantize`, loaded,
run against transformers + compressed-tensors, split over ranks, and refused when malformed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from fp8_oracle import load_fp8_oracle
from helpers import Harness, Oracle, rel_err
from safetensors.torch import load_file, save_file
from test_parity import _tokens

from blockdiff.entrypoints.cli import main as cli
from blockdiff.model.loader import load_model

VOCAB = 301
# FP8 rounds the same values the same way in both; what is left is float32 summation order, as in
# the float32 parity tests (FP8 itself moves these logits by ~0.67 of the largest).
FP8_TOL = 1e-4


@pytest.fixture(scope="module")
def src(checkpoints) -> str:
    return checkpoints("fp8_src", vocab_size=VOCAB, canvas_length=8, sliding_window=6, seed=5)


@pytest.fixture(scope="module")
def fp8(src, tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("fp8") / "model")
    assert cli(["quantize", "--fp8-dynamic", src, dst]) == 0
    return dst


def _logits(ours_or_ref, prompt, canvas):
    ours_or_ref.encode(prompt)
    return ours_or_ref.decode(canvas)


def test_parity_with_transformers_compressed_tensors(fp8, src):
    prompt, canvas = _tokens(13, VOCAB, 0), _tokens(8, VOCAB, 1)
    ours = _logits(Harness(load_model(fp8)), prompt, canvas)
    ref = _logits(Oracle(load_fp8_oracle(fp8)), prompt, canvas)
    full = _logits(Harness(load_model(src)), prompt, canvas)
    err, fp8_err = rel_err(ours, ref), rel_err(ref, full)
    print(f"ours vs oracle {err:.2e}; oracle vs float32 model {fp8_err:.2e}")
    assert err <= FP8_TOL
    assert fp8_err > 10 * FP8_TOL  # the tolerance is far below what FP8 itself changes


def _published_layout(src: str, dst: str) -> str:
    """The published FP8 layout written with compressed-tensors' own quantizer, not ours: per-expert
    Linears, bfloat16 per-tensor scales (the "tensor" strategy) from compressed-tensors' qparams."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True)

    def q(name, w):
        scale, zero = calculate_qparams(w.min().reshape(1), w.max().reshape(1), args)
        scale = scale.to(torch.bfloat16).float()
        return {name + ".weight": quantize(w, scale, zero, args, dtype=torch.float8_e4m3fn), name + ".weight_scale": scale.to(torch.bfloat16)}

    shutil.copytree(src, dst)
    out = {}
    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        base, _, kind = k.rpartition(".")
        if k.startswith("model.decoder.layers.") and kind in ("gate_up_proj", "down_proj"):
            for e, w in enumerate(v):
                parts = zip(("gate_proj", "up_proj"), w.chunk(2)) if kind == "gate_up_proj" else [("down_proj", w)]
                for proj, half in parts:
                    out.update(q(f"{base}.{e}.{proj}", half))
        elif k.startswith("model.decoder.layers.") and "_proj.weight" in k and ".router." not in k:
            out.update(q(k.removesuffix(".weight"), v))
        else:
            out[k] = v
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
            }
        },
        "ignore": ["lm_head", "re:.*embed.*", "re:.*router.*", "re:.*vision.*", "re:.*self_conditioning.*"],
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_published_layout_written_by_compressed_tensors_matches(src, tmp_path):
    path = _published_layout(src, str(tmp_path / "published"))
    model = load_model(path)
    assert model.layers[0].experts.gate_up.dtype == torch.float8_e4m3fn
    assert model.self_conditioning.mlp.gate_up_proj.weight.dtype == torch.float32  # ignored: stays unquantized
    prompt, canvas = _tokens(13, VOCAB, 2), _tokens(8, VOCAB, 3)
    ours = _logits(Harness(model), prompt, canvas)
    ref = _logits(Oracle(load_fp8_oracle(path)), prompt, canvas)
    assert rel_err(ours, ref) <= FP8_TOL


def test_fp8_weights_stay_fp8_and_take_half_the_bytes(src, fp8):
    def weight_bytes(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    q, full = load_model(fp8, dtype=torch.bfloat16), load_model(src, dtype=torch.bfloat16)
    experts = q.layers[0].experts
    assert experts.gate_up.dtype == experts.down.dtype == torch.float8_e4m3fn
    assert q.layers[0].attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    # The tiny model's embedding (tied, kept in bfloat16) is a large share of it, hence not 0.5.
    assert weight_bytes(q) < 0.75 * weight_bytes(full)


def _with_config(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: q.update(quant_method="awq"), "unsupported quantization method 'awq'"),
        (lambda q: q.update(format="nvfp4-pack-quantized"), "unsupported compressed-tensors format 'nvfp4-pack-quantized'"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4), "unsupported weight scheme 'int' 4-bit"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"), "unsupported FP8 weight strategy 'group'"),
        (lambda q: q["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"), "unsupported input activation strategy 'tensor'"),
        (lambda q: q.update(ignore=["lm_head", "re:.*embed.*", "re:.*self_conditioning.*"]), "quantizes the router"),
    ],
)
def test_bad_quantization_config_is_named(fp8, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_model(_with_config(fp8, tmp_path / "bad", edit))


def _with_tensors(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return str(dst)


SCALE = "model.decoder.layers.1.self_attn.q_proj.weight_scale"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop(SCALE), r"missing from checkpoint .*layers\.1\.attn\.qkv_proj\.weight_scale\[part 0\]"),
        (lambda t: t.update({SCALE: t[SCALE][:-1]}), rf"'{SCALE}' has shape"),
        (lambda t: t.update({SCALE[: -len("_scale")]: t[SCALE[: -len("_scale")]].float()}), r"q_proj.weight' is F32, but"),
        (lambda t: t.pop("model.decoder.layers.0.experts.2.down_proj.weight_scale"), r"experts\.down_scale\[part 2\]"),
    ],
)
def test_bad_fp8_tensors_are_named(fp8, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_model(_with_tensors(fp8, tmp_path / "bad", edit))


@pytest.mark.usefixtures("single_threaded_workers")
def test_greedy_generation_equals_oracle_and_tp2(checkpoints, tmp_path):
    from helpers import hf_generate_with_draft, import_test_file
    tp = import_test_file("parallel/test_tensor_parallel.py")
    DRAFTS, GREEDY, PROMPTS, TP_SPEC, _greedy = tp.DRAFTS, tp.GREEDY, tp.PROMPTS, tp.TP_SPEC, tp._greedy

    from blockdiff import LLM

    path = str(tmp_path / "fp8_tp")
    assert cli(["quantize", "--fp8-dynamic", checkpoints("tp", **TP_SPEC), path]) == 0
    params = [_greedy(d) for d in DRAFTS]
    with LLM(path) as llm:
        one = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2) as llm:
        two = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert one == two
    hf = load_fp8_oracle(path)
    eos = set(hf.generation_config.eos_token_id)
    for prompt, draft, ours in zip(PROMPTS, DRAFTS, one):
        theirs = hf_generate_with_draft(hf, prompt, draft, max_new_tokens=22, max_denoising_steps=4, **GREEDY)
        cut = next((i + 1 for i, t in enumerate(theirs) if t in eos), 22)
        assert ours == theirs[:cut]
