"""The integer test oracle: the weights of a compressed-tensors pack-quantized checkpoint as
compressed-tensors itself decompresses them (its ModelCompressor, as transformers calls it on
load), and transformers running them in float32.

transformers 5.23 has no conversion from the per-expert layout to DiffusionGemma's fused 3-D
experts, so the oracle is the float32 source model with every quantized Linear's weight (and the
experts' stacks) replaced by compressed-tensors' dequantized ones.
"""

from __future__ import annotations

import json
import os

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from fp8_oracle import _tensors
from helpers import load_hf
from torch import nn


def decompressed(path: str) -> dict[str, torch.Tensor]:
    """{a quantized Linear's name: its weight, float32} of checkpoint `path`, by compressed-tensors."""
    with open(os.path.join(path, "config.json")) as f:
        config = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    tensors = _tensors(path)
    names = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    root = nn.Module()
    for name in names:
        parent = root
        *path_, leaf = name.split(".")
        for part in path_:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        out, inp = tensors[f"{name}.weight_shape"].tolist()
        parent.add_module(leaf, nn.Linear(inp, out, bias=False, dtype=tensors[f"{name}.weight_scale"].dtype))
    compressor = ModelCompressor(quantization_config=config)
    apply_quantization_config(root, config, show_progress=False)
    compressor.compress_model(root)  # the compressed parameters' shapes, then the checkpoint's values
    state = {k: v for k, v in tensors.items() if k.rpartition(".")[0] in names}
    missing, unexpected = root.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if not m.endswith(".weight")], (missing, unexpected)
    compressor.decompress_model(root)
    return {name: root.get_submodule(name).weight.detach().float() for name in names}


@torch.no_grad()
def with_weights(src: str, weights: dict[str, torch.Tensor]):
    """transformers' float32 model of `src` with the Linears of `weights` (per-expert names stacked into the fused experts)."""
    hf = load_hf(src, experts_implementation="eager")
    decoder, encoder = hf.model.decoder, hf.model.encoder.language_model
    for i, layer in enumerate(decoder.layers):
        prefix = f"model.decoder.layers.{i}."
        for name, w in weights.items():
            if name.startswith(prefix) and ".experts." not in name:
                rest = name[len(prefix):]
                for stack in (layer, encoder.layers[i]):
                    stack.get_submodule(rest).weight.copy_(w)
        gate = f"{prefix}experts.0.gate_proj"
        if gate in weights:
            n = layer.experts.num_experts
            e = f"{prefix}experts"
            gate_up = torch.stack([torch.cat([weights[f"{e}.{j}.gate_proj"], weights[f"{e}.{j}.up_proj"]]) for j in range(n)])
            down = torch.stack([weights[f"{e}.{j}.down_proj"] for j in range(n)])
            for experts in (layer.experts, encoder.layers[i].experts):
                experts.gate_up_proj.copy_(gate_up)
                experts.down_proj.copy_(down)
    return hf
