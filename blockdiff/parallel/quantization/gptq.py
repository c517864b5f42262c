"""GPTQ checkpoints as GPTQModel writes them: the config and the tensors' layout.

A quantized Linear [out, in] stores, per GPTQModel's packing:
- `qweight` [in * bits / 32, out] int32: 32 / bits values of one output column per word, packed
  along the input dimension, lowest bits first, unsigned (0 .. 2^bits - 1);
- `qzeros` [groups, out * bits / 32] int32: the zero points packed the same way along the output
  dimension; the "gptq" (v1) checkpoint format stores each zero point minus one, "gptq_v2" as is;
- `scales` [groups, out] float16;
- `g_idx` [in] int32: the group of every input column. With desc_act (act-order) the columns were
  quantized in order of decreasing activation, so groups are not contiguous: blockdiff reads g_idx
  whatever desc_act says, and keeps every group's scales on every rank.

   W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o]

GPTQModel quantizes the linear layers of the text model's decoder layers (attention, dense MLP and
each expert's gate/up/down, stored per expert as `experts.{e}.gate_proj` ... Linears), not the
routers, the embeddings, the LM head or the vision tower; `dynamic` entries "-:regex" leave the
layers they match unquantized too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from blockdiff.ops.intmm import unpack_int32
from blockdiff.parallel.layers import check_shape
from blockdiff.parallel.quantization.base import ExpertsMethod, LinearMethod, QuantConfig, QuantizationError
from blockdiff.parallel.quantization.fp8 import source_dtype
from blockdiff.parallel.quantization.integer import (
    GROUPS, Q, SCALE, ZERO, IntExpertsMethod, IntLinearMethod, IntScheme, IntTensors, check_bits,
)

QUANT_METHOD = "gptq"
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what the stored zero points lack
_QUANTIZED = re.compile(r".*\.layers\.\d+\.(?!router\.)")  # the decoder layers' linear layers, not the routers


class GptqTensors(IntTensors):
    regular = False
    names = {Q: "qweight", SCALE: "scales", ZERO: "qzeros", GROUPS: "g_idx"}

    def __init__(self, scheme: IntScheme, zero_offset: int):
        super().__init__(scheme)
        self.zero_offset = zero_offset

    def read(self, role: str, source, name: str, rows: slice, out: int, inp: int) -> torch.Tensor:
        bits, groups = self.scheme.bits, self.scheme.groups(inp)
        if role == GROUPS:
            check_shape(name, source, (inp,))
            index = torch.as_tensor(source[:]).long()
            if index.numel() and not (0 <= int(index.min()) and int(index.max()) < groups):
                raise ValueError(f"tensor {name!r} names groups outside 0..{groups - 1}")
            return index
        if role == SCALE:
            check_shape(name, source, (groups, out))
            return torch.as_tensor(source[:, rows]).float().T
        if source_dtype(source) not in ("I32", "int32"):
            raise ValueError(f"tensor {name!r} is {source_dtype(source)}, but GPTQ packs int32 words")
        if role == Q:
            check_shape(name, source, (inp * bits // 32, out))
            return unpack_int32(torch.as_tensor(source[:, rows]), bits, inp, dim=0).T
        check_shape(name, source, (groups, out * bits // 32))
        return (unpack_int32(torch.as_tensor(source[:]), bits, out)[:, rows] + self.zero_offset).float().T


@dataclass(frozen=True)
class GptqConfig(QuantConfig):
    scheme: IntScheme
    zero_offset: int
    skipped: tuple[str, ...]  # `dynamic`'s "-:" patterns

    def quantizes(self, name: str) -> bool:
        return bool(_QUANTIZED.match(name)) and not any(re.match(p, name) for p in self.skipped)

    def _covering(self, *names: str) -> bool:
        quantized = {self.quantizes(n) for n in names}
        if len(quantized) > 1:
            raise QuantizationError(f"GPTQ's dynamic config quantizes some of {', '.join(names[:3])}... but not all; "
                                    "blockdiff runs them as one layer")
        return quantized.pop()

    def linear_method(self, *names: str) -> LinearMethod | None:
        return IntLinearMethod(GptqTensors(self.scheme, self.zero_offset)) if self._covering(*names) else None

    def experts_method(self, *names: str) -> ExpertsMethod | None:
        return IntExpertsMethod(GptqTensors(self.scheme, self.zero_offset)) if self._covering(*names) else None


def parse(raw: dict[str, Any]) -> GptqConfig:
    """A GPTQ quantization_config -> GptqConfig."""
    check_bits("GPTQ", raw.get("bits"))
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ZERO_OFFSET:
        raise QuantizationError(f"unsupported GPTQ checkpoint_format {fmt!r}; blockdiff reads {', '.join(map(repr, ZERO_OFFSET))}")
    if raw.get("pack_dtype", "int32") != "int32":
        raise QuantizationError(f"unsupported GPTQ pack_dtype {raw['pack_dtype']!r}; blockdiff reads int32 words")
    if raw.get("lm_head"):
        raise QuantizationError("GPTQ quantizes the LM head; blockdiff runs it unquantized, tied to the embedding")
    size = raw.get("group_size", 128)
    if not (size == -1 or (isinstance(size, int) and size > 0)):
        raise QuantizationError(f"unsupported GPTQ group_size {size!r}")
    dynamic = raw.get("dynamic") or {}
    overrides = [k for k in dynamic if not k.startswith("-:")]
    if overrides:
        raise QuantizationError(f"unsupported GPTQ dynamic overrides {overrides}; blockdiff reads '-:' (skip) entries only")
    scheme = IntScheme(raw["bits"], None if size == -1 else size, bool(raw.get("sym", True)))
    return GptqConfig(scheme, ZERO_OFFSET[fmt], tuple(k[2:] for k in dynamic))
