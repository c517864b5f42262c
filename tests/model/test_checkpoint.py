"""Checkpoints: the tiny-model writer, loading in both spellings and shards, and every bad-checkpoint error."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import Harness, load_hf, rel_err
from safetensors.torch import load_file, save_file

from blockdiff.config import ConfigError
from blockdiff.model.gemma_config import GemmaConfig
from blockdiff.model.registry import load_config, parse_config
from blockdiff.model.loader import CheckpointError, load_model
from blockdiff.model.tiny import TinySpec, make_tiny_model
from blockdiff.parallel.layers import ShapeMismatch


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_tiny_model_loads_in_transformers_and_generates(tiny):
    from transformers import DiffusionGemmaForBlockDiffusion

    hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(tiny, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    out = hf.generate(torch.tensor([[2, 17, 40, 99]]), max_new_tokens=16, max_denoising_steps=3)
    assert out.sequences.shape == (1, 4 + 16)


def test_tiny_model_randomises_every_tensor(tiny):
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    for name, t in tensors.items():
        assert t.numel() == 1 or t.std() > 0, name
        assert not torch.all(t == 1), f"{name} left at its default of ones"
    for i in range(4):
        enc = tensors[f"model.encoder.language_model.layers.{i}.layer_scalar"]
        dec = tensors[f"model.decoder.layers.{i}.layer_scalar"]
        assert enc.item() != dec.item()


def test_tokenizer_fits_vocabulary_and_roundtrips(tiny):
    from blockdiff.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny)
    assert tok.vocab_size <= 301
    ids = tok.encode("the quick brown fox")
    assert ids[0] == tok.bos_token_id and max(ids) < 301
    assert tok.decode(ids) == "the quick brown fox"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<bos><start_of_turn>user\nhi<end_of_turn>\n") and prompt.endswith("<start_of_turn>model\n")


def test_encoder_spelling_and_sharded_checkpoint_load_the_same(tiny, tmp_path):
    """Shared weights under model.encoder.language_model.*, split over two files with an index."""
    spelled = make_tiny_model(str(tmp_path / "enc"), TinySpec(vocab_size=301, canvas_length=8, sliding_window=6, seed=1, spelling="encoder"))
    tensors = load_file(os.path.join(spelled, "model.safetensors"))
    assert not any(k.startswith("model.decoder.layers.0.self_attn") for k in tensors)
    os.remove(os.path.join(spelled, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(spelled, file))
    with open(os.path.join(spelled, "model.safetensors.index.json"), "w") as f:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: file for file, keys in halves.items() for k in keys}}, f)

    a, b = Harness(load_model(tiny)), Harness(load_model(spelled))
    for h in (a, b):
        h.encode([2, 50, 60, 70])
    canvas = list(range(10, 18))
    assert rel_err(a.decode(canvas), b.decode(canvas)) == 0.0
    # and transformers reads the encoder-spelled, sharded checkpoint the same way
    hf = load_hf(spelled)
    assert torch.equal(hf.model.decoder.layers[0].self_attn.q_proj.weight, load_hf(tiny).model.decoder.layers[0].self_attn.q_proj.weight)


def _edited(src: str, dst, edit) -> str:
    """A copy of checkpoint `src` whose tensors dict went through `edit`; -> its path."""
    path = _copy(src, dst)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def test_missing_tensor_is_named(tiny, tmp_path):
    path = _edited(tiny, tmp_path / "m", lambda t: t.pop("model.decoder.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.mlp\.gate_up_proj\.weight\[part 1\]"):
        load_model(path)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    path = _edited(tiny, tmp_path / "u", lambda t: t.update({"model.decoder.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.decoder\.layers\.0\.mystery\.weight"):
        load_model(path)


def test_extra_part_of_a_fused_weight_is_unexpected(tiny, tmp_path):
    """A v_proj on a layer whose keys are its values has no place in the fused qkv weight."""

    def add_v(tensors):
        layer = next(i for i in range(99) if f"model.decoder.layers.{i}.self_attn.q_proj.weight" in tensors
                     and f"model.decoder.layers.{i}.self_attn.v_proj.weight" not in tensors)
        tensors[f"model.decoder.layers.{layer}.self_attn.v_proj.weight"] = tensors[f"model.decoder.layers.{layer}.self_attn.k_proj.weight"].clone()

    path = _edited(tiny, tmp_path / "v", add_v)
    with pytest.raises(CheckpointError, match=r"unexpected.*self_attn\.v_proj\.weight"):
        load_model(path)


def test_wrong_shape_names_tensor_and_both_shapes(tiny, tmp_path):
    path = _edited(tiny, tmp_path / "s", lambda t: t.update({"model.decoder.layers.2.self_attn.o_proj.weight": torch.zeros(64, 63)}))
    with pytest.raises(ShapeMismatch, match=r"'model\.decoder\.layers\.2\.self_attn\.o_proj\.weight' has shape \[64, 63\], expected \[64, 64\]"):
        load_model(path)


def _edited_config(src: str, dst, edit) -> str:
    """A copy of checkpoint `src` whose config.json dict went through `edit`; -> its path."""
    path = _copy(src, dst)
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    return path


def test_unsupported_architecture(tiny, tmp_path):
    path = _edited_config(tiny, tmp_path / "a", lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"))
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(path)


def test_missing_required_config_field(tiny, tmp_path):
    path = _edited_config(tiny, tmp_path / "c", lambda c: c["text_config"].pop("num_experts"))
    with pytest.raises(ConfigError, match="missing required fields: num_experts"):
        load_config(path)


def test_pickle_only_checkpoint_is_refused(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "p")
    os.remove(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        f.write(b"not unpickled")
    with pytest.raises(CheckpointError, match="only pickle checkpoints.*only safetensors"):
        load_model(path)


def test_config_reads_every_computation_field():
    text = {
        "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
        "top_k_experts": 2, "moe_intermediate_size": 16, "global_head_dim": 16, "num_global_key_value_heads": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 9,
        "use_bidirectional_attention": "all", "eos_token_id": [1, 7], "rms_norm_eps": 1e-5,
        "final_logit_softcapping": 20.0,
    }
    raw = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "text_config": text, "canvas_length": 32, "dtype": "bfloat16"}
    cfg = parse_config(raw)
    # The engine's part: what any architecture gives it.
    assert cfg.architecture == "DiffusionGemmaForBlockDiffusion" and cfg.vocab_size == 100 and cfg.hidden_size == 32
    assert cfg.windows == (9 // 2 + 1, None, None) and cfg.sliding_window == 5 and not cfg.encoder_causal  # last layer: full
    assert cfg.eos_token_ids == (1, 7) and cfg.canvas_length == 32 and cfg.dtype == torch.bfloat16
    assert not hasattr(cfg, "num_experts") and not hasattr(cfg, "layers")  # the rest is the architecture's
    # The architecture's own, which only its model reads.
    gemma = cfg.arch
    assert isinstance(gemma, GemmaConfig)
    assert [layer.sliding for layer in gemma.layers] == [True, False, False]
    assert [layer.head_dim for layer in gemma.layers] == [8, 16, 16]
    assert [layer.num_kv_heads for layer in gemma.layers] == [2, 1, 1]
    assert gemma.layers[1].rotary_dim == 4 and gemma.layers[1].rope_theta == 1e6 and gemma.layers[0].rotary_dim == 8
    assert gemma.rms_norm_eps == 1e-5 and gemma.final_logit_softcapping == 20.0 and gemma.num_experts == 4
    # --num-layers-override cuts both
    two = cfg.first_layers(2)
    assert two.windows == (5, None) and len(two.arch.layers) == 2
    with pytest.raises(ConfigError, match="unsupported architecture"):
        parse_config({**raw, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="missing required fields: num_experts"):
        parse_config({**raw, "text_config": {k: v for k, v in text.items() if k != "num_experts"}})
