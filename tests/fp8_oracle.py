"""The FP8 test oracle: transformers' forward of a compressed-tensors FP8 checkpoint, with the
`compressed-tensors` package doing the (de)quantization.

transformers 5.23 loads the dense Linears of such a checkpoint itself (compressed-tensors'
quantized forward: FP8 weights dequantized, inputs quantized per token). Two gaps are filled here,
each with compressed-tensors' own functions: transformers has no conversion from the per-expert
layout to DiffusionGemma's fused 3-D experts (the experts come up missing), and it does not tie the
encoder's `weight_scale`s to the decoder's as it ties the weights.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from helpers import load_hf
from safetensors import safe_open

TOKEN = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _weight_args(path: str) -> QuantizationArgs:
    with open(os.path.join(path, "config.json")) as f:
        group = next(iter(json.load(f)["quantization_config"]["config_groups"].values()))
    return QuantizationArgs(**group["weights"])


def load_fp8_oracle(path: str):
    hf = load_hf(path, experts_implementation="eager")
    tensors, args = _tensors(path), _weight_args(path)
    # In float32, as transformers decompresses the dense Linears (a bfloat16 product would round).
    dense = lambda name: dequantize(tensors[name + ".weight"], tensors[name + ".weight_scale"].float(), args=args, dtype=torch.float32)
    decoder = hf.model.decoder
    encoder = hf.model.encoder.language_model
    for i, layer in enumerate(decoder.layers):
        for (_, module), (_, twin) in zip(layer.named_modules(), encoder.layers[i].named_modules()):
            if hasattr(module, "weight_scale"):
                twin.weight_scale = module.weight_scale
    # compressed-tensors decompresses on the first forward of the whole model; the oracle calls the
    # encoder alone first, so decompress now (after the scales are tied).
    hf.hf_quantizer.compressor.decompress_model(hf)
    for i, layer in enumerate(decoder.layers):
        prefix = f"model.decoder.layers.{i}.experts"
        gate_up = torch.stack(
            [torch.cat([dense(f"{prefix}.{e}.gate_proj"), dense(f"{prefix}.{e}.up_proj")]) for e in range(layer.experts.num_experts)]
        )
        down = torch.stack([dense(f"{prefix}.{e}.down_proj") for e in range(layer.experts.num_experts)])
        for experts in {layer.experts, encoder.layers[i].experts}:
            experts.gate_up_proj.data, experts.down_proj.data = gate_up, down
            experts.forward = _with_token_quantized_inputs(experts.forward)
    return hf


def _with_token_quantized_inputs(forward):
    """The experts' products with dynamic per-token FP8 inputs, as compressed-tensors quantizes a Linear's."""
    plain = torch.nn.functional.linear

    def quantized_linear(x, weight, bias=None):
        rows = x.unsqueeze(0)  # compressed-tensors' token strategy reads [batch, tokens, features]
        scale, zero = compute_dynamic_scales_and_zp(rows, TOKEN, module=None)
        return plain(fake_quantize(rows, scale, zero, TOKEN)[0], weight, bias)

    def wrapped(*a, **kw):
        with mock.patch("torch.nn.functional.linear", quantized_linear):
            return forward(*a, **kw)

    return wrapped
