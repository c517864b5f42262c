"""FP8 (E4M3) checkpoints of compressed-tensors' `float-quantized` format: the config, and the
quantization methods of the linear layers and the experts.

blockdiff runs one family: FP8 weights with per-channel or per-tensor scales, and activations that
are either quantized per token on the fly (dynamic, "FP8-dynamic"), quantized with a stored
per-tensor scale (static), or left alone (weight-only). Anything else is refused with a ValueError
naming what was found.

Module names follow compressed-tensors' rules (base.matches).

Weights stay FP8 in memory with float32 scales, one per output row (a per-tensor scale is stored
repeated on its rows); each product dequantizes one weight (one expert's) only, so no full-precision
copy of a layer ever exists (blockdiff/ops/fp8.py has the arithmetic).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from blockdiff.ops.fp8 import FP8, fp8_linear, scaled_grouped_linear, sharded_token_scales
from blockdiff.ops.kernels import ExpertRows, per_expert
from blockdiff.parallel.layers import RowParallelLinear, ShapeMismatch, check_shape, copy_into, source_shape
from blockdiff.parallel.quantization.base import (
    ExpertsMethod, LinearMethod, QuantConfig, QuantizationError, expert_weights, matches,
)

QUANT_METHOD = "compressed-tensors"  # the quantization_config's quant_method (registry.py)
FORMAT = "float-quantized"
WEIGHT_STRATEGIES = ("channel", "tensor")


@dataclass(frozen=True)
class Fp8Config(QuantConfig):
    weight_strategy: str  # "channel": one scale per output row; "tensor": one per weight tensor
    activations: str | None  # "dynamic" (per token), "static" (stored per-tensor scale) or None
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def quantizes(self, name: str) -> bool:
        """Whether the linear layer called `name` in the checkpoint holds FP8 weights."""
        return matches(name, self.targets) and not matches(name, self.ignore)

    def covering(self, *names: str) -> "Fp8Config | None":
        """This scheme if it quantizes every one of the checkpoint layers that blockdiff fuses into one
        (q/k/v, gate/up, the experts), None if it quantizes none of them."""
        quantized = [self.quantizes(n) for n in names]
        if all(quantized):
            return self
        if any(quantized):
            raise QuantizationError(
                "quantization_config quantizes "
                f"{', '.join(n for n, q in zip(names, quantized) if q)} but not "
                f"{', '.join(n for n, q in zip(names, quantized) if not q)}; blockdiff runs them as one layer"
            )
        return None

    def linear_method(self, *names: str) -> LinearMethod | None:
        return None if self.covering(*names) is None else Fp8LinearMethod(self)

    def experts_method(self, *names: str) -> ExpertsMethod | None:
        return None if self.covering(*names) is None else Fp8ExpertsMethod(self)

    def to_dict(self) -> dict[str, Any]:
        """The compressed-tensors quantization_config of this scheme."""
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        group: dict[str, Any] = {
            "targets": list(self.targets),
            "weights": {**fp8, "strategy": self.weight_strategy, "dynamic": False},
            "input_activations": None,
            "output_activations": None,
        }
        if self.activations == "dynamic":
            group["input_activations"] = {**fp8, "strategy": "token", "dynamic": True}
        elif self.activations == "static":
            group["input_activations"] = {**fp8, "strategy": "tensor", "dynamic": False}
        return {
            "quant_method": QUANT_METHOD,
            "format": FORMAT,
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }


def parse(raw: dict[str, Any]) -> Fp8Config:
    """A compressed-tensors quantization_config -> Fp8Config."""
    kv = raw.get("kv_cache_scheme")
    if kv and not (_is_fp8(kv) and kv.get("strategy") == "tensor" and not kv.get("dynamic")):
        # A static per-tensor FP8 scheme stores self_attn.k_scale / v_scale, which an FP8 KV cache
        # (--kv-cache-dtype fp8) reads; the cache's dtype is still the flag's, as in vLLM.
        raise QuantizationError(f"unsupported kv_cache_scheme {kv!r}: blockdiff reads static per-tensor FP8 KV "
                                "cache scales only")
    groups = raw.get("config_groups") or {}
    if not groups:
        raise QuantizationError("quantization_config has no config_groups")
    schemes = set()
    targets: list[str] = []
    for name, group in groups.items():
        fmt = group.get("format") or raw.get("format")
        if fmt != FORMAT:
            raise QuantizationError(f"config group {name!r}: unsupported compressed-tensors format {fmt!r}, expected {FORMAT!r}")
        schemes.add((_weight_strategy(name, group.get("weights")), _activations(name, group.get("input_activations"))))
        if group.get("output_activations"):
            raise QuantizationError(f"config group {name!r}: output activation quantization is not supported")
        targets += group.get("targets") or []
    if len(schemes) > 1:
        raise QuantizationError(f"config groups with different schemes {sorted(schemes, key=str)} are not supported")
    if not targets:
        raise QuantizationError("quantization_config targets no module")
    (weights, acts), = schemes
    return Fp8Config(weights, acts, tuple(targets), tuple(raw.get("ignore") or ()))


def _is_fp8(args: dict) -> bool:
    return args.get("type") == "float" and args.get("num_bits") == 8 and args.get("symmetric", True)


def _weight_strategy(group: str, args: dict | None) -> str:
    if not args:
        raise QuantizationError(f"config group {group!r} quantizes no weights")
    if not _is_fp8(args):
        raise QuantizationError(
            f"config group {group!r}: unsupported weight scheme "
            f"{args.get('type')!r} {args.get('num_bits')}-bit (symmetric={args.get('symmetric', True)}); "
            "blockdiff runs symmetric 8-bit float (FP8 E4M3) weights"
        )
    strategy = args.get("strategy")
    if strategy not in WEIGHT_STRATEGIES or args.get("dynamic"):
        raise QuantizationError(
            f"config group {group!r}: unsupported FP8 weight strategy {strategy!r}"
            f"{' (dynamic)' if args.get('dynamic') else ''}; supported: {', '.join(WEIGHT_STRATEGIES)}"
        )
    return strategy


def _activations(group: str, args: dict | None) -> str | None:
    if not args:
        return None
    if not _is_fp8(args):
        raise QuantizationError(
            f"config group {group!r}: unsupported input activation scheme {args.get('type')!r} {args.get('num_bits')}-bit"
        )
    strategy, dynamic = args.get("strategy"), args.get("dynamic")
    if dynamic is True and strategy == "token":
        return "dynamic"
    if dynamic is False and strategy == "tensor":
        return "static"
    raise QuantizationError(
        f"config group {group!r}: unsupported input activation strategy {strategy!r} (dynamic={dynamic}); "
        "supported: dynamic per-token, static per-tensor"
    )


def source_dtype(source) -> str:
    """A safetensors slice's dtype name ("F8_E4M3", "BF16", ...) or a tensor's torch dtype name."""
    return source.get_dtype() if hasattr(source, "get_dtype") else str(source.dtype).removeprefix("torch.")


def check_fp8(name: str, source) -> None:
    if source_dtype(source) not in ("F8_E4M3", "float8_e4m3fn"):
        raise ValueError(
            f"tensor {name!r} is {source_dtype(source)}, but the quantization_config makes it an FP8 (E4M3) weight"
        )


def load_scale(dst: torch.Tensor, source, name: str, rows: int, start: int, local: int) -> None:
    """Copy a weight's scales into dst [local, 1]: a per-channel scale [rows, 1] is sliced like the
    weight's rows, a per-tensor scale ([1] or []) repeated on them."""
    shape = source_shape(source)
    if shape in ((), (1,)):
        dst.copy_(torch.as_tensor(source[:] if shape else source[()]).float().reshape(1, 1).expand_as(dst))
        return
    check_shape(name, source, (rows, 1))
    copy_into(dst, source[start : start + local])


def load_input_scale(param: torch.Tensor, source, name: str, *part) -> None:
    """A static activation scale. Layers fused from several checkpoint tensors (q/k/v) and the experts
    quantize their shared input once, with the largest of the tensors' scales, as vLLM does."""
    if source_shape(source) not in ((), (1,)):
        raise ShapeMismatch(f"tensor {name!r} has shape {list(source_shape(source))}, expected a per-tensor scale [1]")
    value = torch.as_tensor(source[:] if source_shape(source) else source[()]).float().reshape(1)
    param.data.copy_(torch.maximum(param.data, value))


def _input_scale(num_parts: int) -> nn.Parameter:
    scale = nn.Parameter(torch.zeros(1), requires_grad=False)
    scale.weight_loader = load_input_scale
    scale.num_parts = num_parts
    return scale


class Fp8LinearMethod(LinearMethod):
    """FP8 weight [out, in] and float32 scales per row; for static activations, the input scale."""

    def __init__(self, config: Fp8Config):
        self.activations = config.activations

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        layer.weight.weight_loader = functools.partial(self.load_weight, layer)
        layer.weight.num_parts = layer.num_parts
        layer.weight_scale = nn.Parameter(torch.empty(out_features, 1), requires_grad=False)
        layer.weight_scale.weight_loader = functools.partial(self.load_scale, layer)
        layer.weight_scale.num_parts = layer.num_parts
        layer.input_scale = _input_scale(layer.num_parts) if self.activations == "static" else None

    def load_weight(self, layer: nn.Module, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        check_fp8(name, source)
        layer.load_weight(param, source, name, part)

    def load_scale(self, layer: nn.Module, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        """Each part's scales are sliced with its rows."""
        global_rows, local, start, off = layer.output_rows(part)
        load_scale(param.data[off : off + local], source, name, global_rows, start, local)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # A row-parallel layer's x is this rank's slice of each row: its dynamic scales are the max over ranks.
        sharded = isinstance(layer, RowParallelLinear) and layer.reduce and self.activations == "dynamic"
        scales = sharded_token_scales(x, layer.group) if sharded else None
        return fp8_linear(x, layer.weight, layer.weight_scale, self.activations, layer.input_scale, scales)


class Fp8ExpertsMethod(ExpertsMethod):
    """FP8 experts, loaded from the per-expert layout of compressed-tensors checkpoints
    (`experts.{e}.gate_proj/up_proj/down_proj` Linears): part 2e / 2e+1 of gate_up is expert e's
    gate / up, part e of down is its down."""

    def __init__(self, config: Fp8Config):
        self.activations = config.activations

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return FP8

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        expert_weights(layer, dtype)
        e = layer.num_experts
        # Padded rows get a scale of one: their weights are zero, and 0 * an uninitialised scale could be NaN.
        layer.gate_up_scale = nn.Parameter(torch.ones(e, 2 * layer.local, 1), requires_grad=False)
        layer.down_scale = nn.Parameter(torch.ones(e, layer.hidden_in, 1), requires_grad=False)
        for name in ("gate_up", "gate_up_scale", "down", "down_scale"):
            getattr(layer, name).weight_loader = functools.partial(getattr(self, f"load_{name}"), layer)
        params = [layer.gate_up, layer.gate_up_scale, layer.down, layer.down_scale]
        layer.gate_up_input_scale = layer.down_input_scale = None
        if self.activations == "static":
            # One input scale per projection for all experts (the largest of theirs), as vLLM does.
            layer.gate_up_input_scale, layer.down_input_scale = _input_scale(2 * e), _input_scale(e)
        for p, parts in zip(params, [2 * e, 2 * e, e, e]):
            p.num_parts = parts

    @staticmethod
    def _gate_up_rows(layer: nn.Module, part: int) -> tuple[int, slice]:
        """part -> (expert, the rows of its gate or up in the local gate_up)."""
        expert, which = divmod(part, 2)
        return expert, layer.halves()[which]

    def load_gate_up(self, layer: nn.Module, param: torch.Tensor, source, name: str, part: int) -> None:
        check_fp8(name, source)
        check_shape(name, source, (layer.inter, layer.hidden))
        expert, rows = self._gate_up_rows(layer, part)
        copy_into(param.data[expert, rows, : layer.hidden], source[layer.lo : layer.lo + layer.owned])

    def load_gate_up_scale(self, layer: nn.Module, param: torch.Tensor, source, name: str, part: int) -> None:
        expert, rows = self._gate_up_rows(layer, part)
        load_scale(param.data[expert, rows], source, name, layer.inter, layer.lo, layer.owned)

    def load_down(self, layer: nn.Module, param: torch.Tensor, source, name: str, part: int) -> None:
        check_fp8(name, source)
        check_shape(name, source, (layer.hidden, layer.inter))
        copy_into(param.data[part, : layer.hidden, : layer.owned], source[:, layer.lo : layer.lo + layer.owned])

    def load_down_scale(self, layer: nn.Module, param: torch.Tensor, source, name: str, part: int) -> None:
        load_scale(param.data[part, : layer.hidden], source, name, layer.hidden, 0, layer.hidden)

    def apply(self, layer: nn.Module, projection: str, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """Grouped rows: torch._scaled_grouped_mm (kernels.SCALED_GROUPED), the activations quantized
        to FP8 per row (or with the static input scale), the weights' row scales applied in the
        product; else one product per busy expert, each dequantizing that expert's weight only."""
        weight, scale = getattr(layer, projection), getattr(layer, f"{projection}_scale")
        input_scale = getattr(layer, f"{projection}_input_scale")
        # Under TP each rank holds a slice of every expert's width: down's rows are scaled by a max-reduce.
        sharded = projection == "down" and layer.reduce and self.activations == "dynamic"
        if rows.ends is not None:
            scales = sharded_token_scales(x, layer.group) if sharded else None
            return scaled_grouped_linear(x, weight, scale, rows.ends, self.activations, input_scale, scales)

        def product(part: torch.Tensor, e: int) -> torch.Tensor:
            scales = sharded_token_scales(part, layer.group) if sharded else None
            return fp8_linear(part, weight[e], scale[e], self.activations, input_scale, scales)

        return per_expert(x, rows.sizes, product)
