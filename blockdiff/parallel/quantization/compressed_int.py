"""Integer weight-only checkpoints of compressed-tensors' `pack-quantized` format, as llm-compressor
writes them (W4A16, W8A16 and mixed schemes): the config and the tensors' layout.

A quantized Linear stores `weight_packed` [out, ceil(in * bits / 32)] int32 (32 / bits values per
word, lowest bits first, offset by 2^(bits-1)), `weight_scale` [out, groups] (one group per output
row for the "channel" strategy), `weight_shape` [out, in] and, for asymmetric schemes,
`weight_zero_point` packed the same way along its rows [ceil(out * bits / 32), groups]. Groups are
contiguous runs of group_size input columns. Config groups may give different layers different
schemes (experts in 4 bits, the rest in 8); a layer takes the scheme of the group that names it most
closely (base.match_rank), and the ignore list wins over every target.

blockdiff runs 4- and 8-bit integer weights with "group" or "channel" scales, symmetric or not,
unquantized activations. Anything else is refused with one line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from blockdiff.ops.intmm import unpack_int32
from blockdiff.parallel.layers import ShapeMismatch, check_shape
from blockdiff.parallel.quantization.base import (
    ExpertsMethod, LinearMethod, QuantConfig, QuantizationError, match_rank, matches,
)
from blockdiff.parallel.quantization.fp8 import source_dtype
from blockdiff.parallel.quantization.integer import (
    Q, SCALE, SHAPE, ZERO, IntExpertsMethod, IntLinearMethod, IntScheme, IntTensors, check_bits,
)

FORMAT = "pack-quantized"
STRATEGIES = ("group", "channel")


class PackedTensors(IntTensors):
    regular = True

    def __init__(self, scheme: IntScheme):
        super().__init__(scheme)
        self.names = {Q: "weight_packed", SCALE: "weight_scale", SHAPE: "weight_shape"}
        if not scheme.symmetric:
            self.names[ZERO] = "weight_zero_point"

    def read(self, role: str, source, name: str, rows: slice, out: int, inp: int) -> torch.Tensor | None:
        bits, groups = self.scheme.bits, self.scheme.groups(inp)
        if role == Q:
            check_shape(name, source, (out, -(-inp * bits // 32)))
            if source_dtype(source) not in ("I32", "int32"):
                raise ValueError(f"tensor {name!r} is {source_dtype(source)}, but pack-quantized weights are int32 words")
            return unpack_int32(torch.as_tensor(source[rows]), bits, inp)
        if role == SCALE:
            check_shape(name, source, (out, groups))
            return torch.as_tensor(source[rows]).float()
        if role == ZERO:
            check_shape(name, source, (-(-out * bits // 32), groups))
            return unpack_int32(torch.as_tensor(source[:]), bits, out, dim=0)[rows].float()
        shape = torch.as_tensor(source[:]).tolist()
        if shape != [out, inp]:
            raise ShapeMismatch(f"tensor {name!r} says the weight is {shape}, expected {[out, inp]}")
        return None


@dataclass(frozen=True)
class CompressedIntConfig(QuantConfig):
    groups: tuple[tuple[tuple[str, ...], IntScheme], ...]  # per config group: (targets, scheme)
    ignore: tuple[str, ...]

    def scheme(self, name: str) -> IntScheme | None:
        """The scheme of the checkpoint's linear layer `name`: its most specific target's, None if ignored or untargeted."""
        if matches(name, self.ignore):
            return None
        ranked = [(max((match_rank(name, t) for t in targets), default=0), scheme) for targets, scheme in self.groups]
        best = max((rank for rank, _ in ranked), default=0)
        return next(scheme for rank, scheme in ranked if rank == best) if best else None

    def covering(self, *names: str) -> IntScheme | None:
        """The one scheme of the checkpoint layers that blockdiff fuses into one layer (q/k/v, gate/up, the experts)."""
        schemes = {n: self.scheme(n) for n in names}
        if len(set(schemes.values())) > 1:
            found = ", ".join(f"{n}: {s or 'unquantized'}" for n, s in list(schemes.items())[:4])
            raise QuantizationError(f"quantization_config quantizes layers that blockdiff runs as one layer differently ({found})")
        return schemes[names[0]]

    def linear_method(self, *names: str) -> LinearMethod | None:
        scheme = self.covering(*names)
        return None if scheme is None else IntLinearMethod(PackedTensors(scheme))

    def experts_method(self, *names: str) -> ExpertsMethod | None:
        scheme = self.covering(*names)
        return None if scheme is None else IntExpertsMethod(PackedTensors(scheme))


def _scheme(group: str, weights: dict | None) -> IntScheme:
    if not weights:
        raise QuantizationError(f"config group {group!r} quantizes no weights")
    if weights.get("type") != "int":
        raise QuantizationError(f"config group {group!r}: unsupported {FORMAT} weight type {weights.get('type')!r}; "
                                "blockdiff runs integer weights in this format")
    check_bits(f"config group {group!r}", weights.get("num_bits"))
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES or weights.get("dynamic"):
        raise QuantizationError(f"config group {group!r}: unsupported integer weight strategy {strategy!r}"
                                f"{' (dynamic)' if weights.get('dynamic') else ''}; supported: {', '.join(STRATEGIES)}")
    if weights.get("actorder") == "group":
        raise QuantizationError(f"config group {group!r}: unsupported activation ordering 'group' (weight_g_idx); "
                                "blockdiff runs compressed-tensors integer weights in their columns' order")
    size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(size, int) and size > 0):
        raise QuantizationError(f"config group {group!r}: group strategy with group_size {size!r}")
    return IntScheme(weights["num_bits"], size, weights.get("symmetric", True))


def parse(raw: dict[str, Any]) -> CompressedIntConfig:
    """A compressed-tensors quantization_config whose groups are all pack-quantized -> CompressedIntConfig."""
    if raw.get("kv_cache_scheme"):
        raise QuantizationError(f"unsupported kv_cache_scheme {raw['kv_cache_scheme']!r} with {FORMAT} weights")
    groups = []
    for name, group in (raw.get("config_groups") or {}).items():
        acts = group.get("input_activations")
        if acts:
            raise QuantizationError(f"config group {name!r}: unsupported input activation quantization "
                                    f"{acts.get('type')!r} {acts.get('num_bits')}-bit; blockdiff runs weight-only "
                                    "integer schemes (W4A16, W8A16)")
        if group.get("output_activations"):
            raise QuantizationError(f"config group {name!r}: output activation quantization is not supported")
        groups.append((tuple(group.get("targets") or ()), _scheme(name, group.get("weights"))))
    if not any(targets for targets, _ in groups):
        raise QuantizationError("quantization_config targets no module")
    return CompressedIntConfig(tuple(groups), tuple(raw.get("ignore") or ()))
