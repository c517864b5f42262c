"""Integer weight-only schemes for `blockdiff quantize` (W8A16, W4A16, mixed), written the way
llm-compressor saves a model: the Linears are given a compressed-tensors `QuantizationConfig`
(apply_quantization_config), their scales and zero points come from each group's min and max (what
llm-compressor's default min-max observer computes for a weight), and compressed-tensors' own
`ModelCompressor` packs them (`pack-quantized`) and writes the quantization_config. quantize.py
walks the checkpoint; this module quantizes the Linears it hands over.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs, QuantizationConfig, QuantizationScheme, QuantizationStatus, apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from torch import nn

from blockdiff.model.quantize import DEFAULT_IGNORE, check_float
from blockdiff.parallel.quantization.compressed_int import FORMAT, parse

EXPERTS = "re:.*experts.*"


def int_config(scheme: str, group_size: int, ignore: tuple[str, ...] = DEFAULT_IGNORE) -> QuantizationConfig:
    """The QuantizationConfig of a named scheme: w8a16 int8 per-channel, w4a16 int4 in groups of
    `group_size`, mixed the experts in int4 and every other Linear in int8 (mlx-vlm's finding: 8-bit
    attention and dense layers keep the 4-bit experts' error from compounding); symmetric, weights only."""
    int8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    int4 = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    groups = {
        "w8a16": {"group_0": QuantizationScheme(targets=["Linear"], weights=int8)},
        "w4a16": {"group_0": QuantizationScheme(targets=["Linear"], weights=int4)},
        "mixed": {"group_0": QuantizationScheme(targets=[EXPERTS], weights=int4),
                  "group_1": QuantizationScheme(targets=["Linear"], weights=int8)},
    }
    if scheme not in groups:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(groups)}")
    return QuantizationConfig(config_groups=groups[scheme], ignore=list(ignore), format=FORMAT)


def _tree(modules: list[tuple[str, torch.Tensor]]) -> nn.Module:
    """A module tree holding an nn.Linear of each weight under its checkpoint name."""
    root = nn.Module()
    for name, weight in modules:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        parent.add_module(leaf, linear)
    return root


@torch.no_grad()
def _observe(module: nn.Linear, name: str) -> None:
    """Min-max scales and zero points of a Linear's weight per row and group."""
    args = module.quantization_scheme.weights
    w = module.weight
    if args.strategy == "group":
        if w.shape[1] % args.group_size:
            raise ValueError(f"{name} has {w.shape[1]} input columns, not a multiple of the group size {args.group_size}")
        w = w.reshape(w.shape[0], -1, args.group_size)
    else:
        w = w.unsqueeze(1)
    scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
    module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.copy_(zero.to(module.weight_zero_point.dtype))


class IntWriter:
    """quantize.Scheme of a compressed-tensors integer QuantizationConfig."""

    def __init__(self, config: QuantizationConfig):
        self.config = config
        self.parsed = parse(config.model_dump(mode="json"))  # the layers it quantizes, as blockdiff will read them

    def quantizes(self, module: str) -> bool:
        return self.parsed.scheme(module) is not None

    def quantize(self, modules: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if not modules:
            return []
        for name, weight in modules:
            check_float(name, weight)
        tree = _tree(modules)
        apply_quantization_config(tree, self.config, show_progress=False)
        for name, _ in modules:
            _observe(tree.get_submodule(name), name)
        ModelCompressor.from_pretrained_model(tree, FORMAT).compress_model(tree)
        state = tree.state_dict()
        unpacked = [name for name, _ in modules if f"{name}.weight_packed" not in state]
        if unpacked:
            raise ValueError(f"compressed-tensors left {', '.join(unpacked[:3])} unquantized")
        return list(state.items())

    def save_config(self, dst: str) -> None:
        config = self.config.model_copy(update={"quantization_status": QuantizationStatus.COMPRESSED})
        ModelCompressor(quantization_config=config).update_config(dst)
