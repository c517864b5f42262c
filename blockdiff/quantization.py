"""The checkpoint's `quantization_config`, read once: which FP8 scheme, and which modules it covers.

blockdiff runs one family: compressed-tensors `float-quantized` FP8 (E4M3) weights with per-channel
or per-tensor scales, and activations that are either quantized per token on the fly (dynamic,
"FP8-dynamic"), quantized with a stored per-tensor scale (static), or left alone (weight-only).
Anything else is refused with a ValueError naming what was found.

Module names follow compressed-tensors' rules: a target or ignore entry either equals the module's
name or, prefixed with "re:", is a regular expression matched from the start of the name; the
target "Linear" names every linear layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FORMAT = "float-quantized"
WEIGHT_STRATEGIES = ("channel", "tensor")


class QuantizationError(ValueError):
    """A quantization_config blockdiff cannot run."""


@dataclass(frozen=True)
class Fp8Config:
    weight_strategy: str  # "channel": one scale per output row; "tensor": one per weight tensor
    activations: str | None  # "dynamic" (per token), "static" (stored per-tensor scale) or None
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def quantizes(self, name: str) -> bool:
        """Whether the linear layer called `name` in the checkpoint holds FP8 weights."""
        return _matches(name, self.targets) and not _matches(name, self.ignore)

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
            "quant_method": "compressed-tensors",
            "format": FORMAT,
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    for p in patterns:
        if p == "Linear" or p == name or (p.startswith("re:") and re.match(p[3:], name)):
            return True
    return False


def covering(quant: Fp8Config | None, *names: str) -> Fp8Config | None:
    """The scheme of the layer fused from checkpoint layers `names`; None for plain weights."""
    return None if quant is None else quant.covering(*names)


def parse_quantization(raw: dict[str, Any] | None) -> Fp8Config | None:
    """config.json's quantization_config -> Fp8Config, or None for an unquantized checkpoint."""
    if raw is None:
        return None
    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise QuantizationError(
            f"unsupported quantization method {method!r}: blockdiff runs compressed-tensors FP8 "
            f"({FORMAT!r}) checkpoints only"
        )
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
