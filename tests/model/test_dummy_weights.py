"""Dummy weights (load_format="dummy"): a model built from a config.json alone, no tensor read;
the shipped DiffusionGemma-26B-A4B config's shapes; --num-layers-override."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from blockdiff import LLM, SamplingParams
from blockdiff.demo import demo_checkpoint
from blockdiff.model.loader import DUMMY_RANGE
from blockdiff.model.registry import model_class, parse_config

BIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "diffusiongemma-26b-a4b.json")


def test_the_26b_config_has_the_released_shapes_and_size():
    config = parse_config(json.load(open(BIG)))
    with torch.device("meta"):  # shapes only: nothing allocated
        model = model_class(config)(config, dtype=torch.bfloat16)
    gemma = config.arch
    full = [i for i, spec in enumerate(gemma.layers) if not spec.sliding]
    assert config.num_layers == 30 and full == [5, 11, 17, 23, 29]
    assert {(s.head_dim, s.num_kv_heads, s.window) for s in gemma.layers if s.sliding} == {(256, 8, 1024)}
    assert {(s.head_dim, s.num_kv_heads) for s in gemma.layers if not s.sliding} == {(512, 2)}
    assert (config.hidden_size, gemma.num_heads, gemma.intermediate_size) == (2816, 16, 2112)
    assert (gemma.num_experts, gemma.top_k_experts, gemma.moe_intermediate_size) == (128, 8, 704)
    assert (config.vocab_size, config.canvas_length, config.dtype) == (262_144, 256, torch.bfloat16)
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    experts = sum(v for k, v in sizes.items() if ".experts." in k)
    # DESIGN.md §9: ~51.6 GB with the vision tower (which blockdiff skips), ~45.7 GB of it experts.
    assert 45.6e9 < experts < 45.8e9
    assert 50.3e9 < sum(sizes.values()) < 51.6e9


def test_dummy_weights_generate_from_a_config_alone(tmp_path):
    shutil.copy(os.path.join(demo_checkpoint(), "config.json"), tmp_path / "config.json")  # no weights beside it
    params = SamplingParams(max_tokens=8, max_denoising_steps=2, seed=0, ignore_eos=True)
    with LLM(str(tmp_path / "config.json"), load_format="dummy", tokenizer=demo_checkpoint(),
             num_layers_override=1) as llm:
        model = llm.engine.executor.runner.model
        out = llm.generate([[2, 10, 11]], params, use_tqdm=False)[0]
        weights = list(model.parameters())
    assert len(model.layers) == 1
    assert all(p.abs().max() <= DUMMY_RANGE for p in weights) and all(p.abs().max() > 0 for p in weights if p.numel() > 8)
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("options, match", [
    (dict(load_format="safetensors"), "load_format must be one of"),
    (dict(num_layers_override=1), "num_layers_override needs load_format='dummy'"),
    (dict(load_format="dummy", num_layers_override=0), "num_layers_override must be a positive integer"),
    (dict(load_format="dummy", num_layers_override=99), "num_layers_override 99 exceeds the model's 4 layers"),
    (dict(sampler_memory_gb=0), "sampler_memory_gb must be a positive number"),
])
def test_bad_options_name_themselves(options, match):
    with pytest.raises(ValueError, match=match):
        LLM(demo_checkpoint(), **options)
