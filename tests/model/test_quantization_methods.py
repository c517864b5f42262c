"""A second quantization format, written here as a format's one module would be: float16 weights
widened to the activations' dtype in `apply`, for the linear layers and the experts. Registered by
its `quant_method`, it runs a tiny model through load_model and LLM.generate."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import Harness, rel_err
from test_parity import _tokens

from blockdiff import LLM
from blockdiff.model.gemma_checkpoint import map_name
from blockdiff.model.loader import load_model
from blockdiff.ops.kernels import ExpertRows, expert_linear
from blockdiff.ops.matmul import linear
from blockdiff.parallel.quantization.base import (
    UNQUANTIZED_EXPERTS, UNQUANTIZED_LINEAR, ExpertsMethod, LinearMethod, QuantConfig,
)
from blockdiff.parallel.quantization.registry import FORMATS
from blockdiff.sampling_params import SamplingParams

VOCAB = 301
STORED = torch.float16


class HalfLinear(LinearMethod):
    def create_weights(self, layer, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        UNQUANTIZED_LINEAR.create_weights(layer, out_features, in_features, STORED)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.weight.to(x.dtype))


class HalfExperts(ExpertsMethod):
    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return STORED

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        UNQUANTIZED_EXPERTS.create_weights(layer, dtype)

    def apply(self, layer, projection: str, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        return expert_linear(x, getattr(layer, projection).to(x.dtype), rows)


class HalfConfig(QuantConfig):
    """Every layer but those blockdiff runs unquantized (the LM head and the routers)."""

    @staticmethod
    def parse(raw: dict) -> HalfConfig:
        return HalfConfig()

    def linear_method(self, *names: str) -> LinearMethod | None:
        return None if any(n == "lm_head" or ".router." in n for n in names) else HalfLinear()

    def experts_method(self, *names: str) -> ExpertsMethod | None:
        return HalfExperts()


@pytest.fixture
def half(checkpoints, tmp_path, monkeypatch) -> tuple[str, str]:
    """(the float32 tiny checkpoint, the same tensors under a quantization_config of the float16 format)."""
    monkeypatch.setitem(FORMATS, "half", HalfConfig.parse)
    src = checkpoints("fp8_src", vocab_size=VOCAB, canvas_length=8, sliding_window=6, seed=5)
    dst = str(tmp_path / "half")
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "half"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return src, dst


def _logits(model) -> torch.Tensor:
    h = Harness(model)
    h.encode(_tokens(13, VOCAB, 0))
    return h.decode(_tokens(8, VOCAB, 1))


def test_a_registered_format_runs_the_model(half):
    src, dst = half
    model = load_model(dst)
    layer = model.layers[0]
    stored = [layer.attn.qkv_proj.weight, layer.attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
              layer.experts.gate_up, layer.experts.down, model.self_conditioning.mlp.gate_up_proj.weight]
    assert {w.dtype for w in stored} == {STORED}
    assert layer.router.proj.weight.dtype == torch.float32
    ours, plain = _logits(model), _logits(load_model(src))
    err = rel_err(ours, plain)
    print(f"float16 weights against float32: {err:.2e}")
    # float16 rounds each weight by at most 2^-11 of it; the logits move by about that, not by more
    assert 0 < err < 1e-2

    params = SamplingParams(max_tokens=16, max_denoising_steps=4, t_min=1e-6, t_max=2e-6)
    with LLM(dst) as llm:
        out = llm.generate([_tokens(5, VOCAB, 2)], params, use_tqdm=False)
    assert 0 < len(out[0].token_ids) <= 16


def test_a_formats_companion_tensors_map_beside_their_weight():
    """Whatever a format stores beside a weight (FP8's weight_scale, another's zero points) loads into
    the parameter its method names alike: no table of suffixes to extend."""
    layer = "model.decoder.layers.0"
    assert map_name(f"{layer}.self_attn.k_proj.weight_zero_point") == ("layers.0.attn.qkv_proj.weight_zero_point", 1)
    assert map_name(f"{layer}.experts.3.up_proj.weight_zero_point") == ("layers.0.experts.gate_up_zero_point", 7)
    assert map_name(f"{layer}.experts.3.down_proj.input_scale") == ("layers.0.experts.down_input_scale", 3)
    assert map_name(f"{layer}.router.per_expert_scale") == ("layers.0.router.per_expert_scale", None)
