"""Weight-only integer layers (W4A16, W8A16): what the integer formats share.

A format (compressed_int.py, gptq.py) says how its checkpoint stores a Linear's tensors; it reads
each as the logical tensor of the rows this rank needs (`IntTensors`): q [rows, in] int8 (4-bit
values included), scale and zero [rows, groups] float32, and, where the format stores one, each
Linear's group of every input column (GPTQ's g_idx). The methods here keep them in memory in that
logical layout, unpacked (ops/intmm.py multiplies it), and shard them as the layers' geometry says:
a column-parallel layer's rows, a row-parallel layer's input columns together with the groups those
columns fall in (a group cut by a rank boundary has its scale on both ranks), the experts' slices of
their intermediate width.

Parameters are named as map_name (model/gemma_checkpoint.py) names the format's tensors beside
X.weight: "qkv_proj.weight_packed", "experts.gate_up_packed", "qkv_proj.qweight", ...
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from blockdiff.ops.intmm import Segments, fast_kernel, int_linear, regular_groups
from blockdiff.ops.kernels import ExpertRows, per_expert
from blockdiff.parallel.layers import RowParallelLinear
from blockdiff.parallel.quantization.base import ExpertsMethod, LinearMethod, QuantizationError

Q, SCALE, ZERO, GROUPS, SHAPE = "q", "scale", "zero", "groups", "shape"  # the roles of a format's tensors


@dataclass(frozen=True)
class IntScheme:
    bits: int  # 4 or 8
    group_size: int | None  # None: one scale per output row
    symmetric: bool

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size is None else -(-in_features // self.group_size)

    def __str__(self) -> str:
        kind = "per-channel" if self.group_size is None else f"group size {self.group_size}"
        return f"int{self.bits} {kind} {'symmetric' if self.symmetric else 'asymmetric'}"


BITS = (4, 8)


def check_bits(what: str, bits) -> None:
    if bits not in BITS:
        raise QuantizationError(f"{what}: unsupported integer width {bits!r}; blockdiff runs {' and '.join(f'{b}-bit' for b in BITS)} weights")


class IntTensors(ABC):
    """One format's checkpoint tensors of a Linear [out, in], read as the rows this rank needs."""

    names: dict[str, str]  # role -> the tensor's suffix in the checkpoint ("weight_packed", "qweight", ...)
    regular: bool  # groups are contiguous runs of group_size columns (else the checkpoint's GROUPS says)

    def __init__(self, scheme: IntScheme):
        self.scheme = scheme

    @abstractmethod
    def read(self, role: str, source, name: str, rows: slice, out: int, inp: int) -> torch.Tensor:
        """Q: [rows, inp] int8; SCALE, ZERO: [rows, groups] float32; GROUPS: [inp] long; SHAPE: checked only (None)."""


def _param(t: torch.Tensor, loader, parts: int) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader, p.num_parts = loader, parts
    return p


def _columns(layer: nn.Module) -> tuple[int, int, int]:
    """(the checkpoint's input features, the first this rank holds, how many it holds)."""
    if isinstance(layer, RowParallelLinear):
        return layer.in_features, layer.group.rank * layer.local_in, layer.local_in
    return layer.in_features, 0, layer.in_features


def _aligned(tensors: IntTensors, columns: int, first: int, real: int) -> bool:
    """Whether a weight of `columns` in memory, of which the first `real` are the checkpoint's
    columns first..., has its groups in contiguous runs from column 0 (ops/intmm.py Segments)."""
    size = tensors.scheme.group_size
    if not tensors.regular:
        return False
    return size is None or (real == columns and columns % size == 0 and first % size == 0)


def _kernel(tensors: IntTensors, rows: int, columns: int, first: int, real: int) -> str | None:
    """torch's CPU kernel for such a weight of `rows` rows, or None (ops/intmm.py fast_kernel)."""
    s = tensors.scheme
    if not _aligned(tensors, columns, first, real):
        return None
    return fast_kernel(s.bits, s.group_size, s.symmetric, rows, columns, first)


def _group_span(tensors: IntTensors, inp: int, first: int, n: int) -> tuple[int, int]:
    """(the first group of columns first..first+n-1, how many groups this rank keeps)."""
    scheme = tensors.scheme
    if not tensors.regular or scheme.group_size is None:
        return 0, scheme.groups(inp)
    g0 = first // scheme.group_size
    return g0, (first + n - 1) // scheme.group_size - g0 + 1


class IntLinearMethod(LinearMethod):
    def __init__(self, tensors: IntTensors):
        self.tensors = tensors

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        t, parts = self.tensors, layer.num_parts
        inp, first, n = _columns(layer)
        g0, groups = _group_span(t, inp, first, n)
        shapes = {Q: ((out_features, n), torch.int8), SCALE: ((out_features, groups), torch.float32),
                  ZERO: ((out_features, groups), torch.float32), GROUPS: ((parts, n), torch.long),
                  SHAPE: ((0,), torch.long)}
        for role, suffix in t.names.items():
            shape, kind = shapes[role]
            loader = functools.partial(self._load, layer, role, first, n, g0)
            setattr(layer, suffix, _param(torch.zeros(shape, dtype=kind), loader, parts))
        if t.regular:
            layer.register_buffer("group_index", regular_groups(first, n, t.scheme.group_size), persistent=False)
        self.kernel = _kernel(t, out_features, n, first, n)
        self.aligned = _aligned(t, n, first, n)

    def _load(self, layer: nn.Module, role: str, first: int, n: int, g0: int,
              param: torch.Tensor, source, name: str, part: int = 0) -> None:
        global_rows, local, start, off = layer.output_rows(part)
        value = self.tensors.read(role, source, name, slice(start, start + local), global_rows, _columns(layer)[0])
        if role == Q:
            param.data[off : off + local] = value[:, first : first + n]
        elif role in (SCALE, ZERO):
            param.data[off : off + local] = value[:, g0 : g0 + param.shape[1]]
        elif role == GROUPS:
            param.data[part] = value[first : first + n]

    def segments(self, layer: nn.Module) -> Segments:
        if self.tensors.regular:
            return [(0, getattr(layer, self.tensors.names[Q]).shape[0], None if self.aligned else layer.group_index)]
        groups = getattr(layer, self.tensors.names[GROUPS])
        return [(off, off + local, groups[p]) for p in range(layer.num_parts)
                for _, local, _, off in [layer.output_rows(p)]]

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        names = self.tensors.names
        zero = getattr(layer, names[ZERO]) if ZERO in names else None
        return int_linear(x, getattr(layer, names[Q]), getattr(layer, names[SCALE]), zero, self.segments(layer), self.kernel)


def expert_name(projection: str, suffix: str) -> str:
    """The experts' parameter of a per-expert tensor "X.{suffix}" (as map_name names it)."""
    return f"{projection}_{suffix.removeprefix('weight_')}"


class IntExpertsMethod(ExpertsMethod):
    """Integer experts, loaded from the per-expert Linears `experts.{e}.gate_proj/up_proj/down_proj`:
    part 2e / 2e+1 of gate_up is expert e's gate / up, part e of down its down. In memory
    gate_up [E, 2W, H'] and down [E, H', W] like the unquantized experts (padding included: its
    scales are zero, so its weights are too), each expert's product dequantizing that expert only."""

    def __init__(self, tensors: IntTensors):
        self.tensors = tensors
        self.kernels: dict[str, str | None] = {}  # per projection
        self.aligned: dict[str, bool] = {}

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.int8

    def _geometry(self, layer: nn.Module, projection: str) -> tuple[int, int, int, int, int]:
        """(rows in memory, the checkpoint's input features, the first this rank holds, how many, columns in memory)."""
        if projection == "gate_up":
            return 2 * layer.local, layer.hidden, 0, layer.hidden, layer.hidden_in
        return layer.hidden_in, layer.inter, layer.lo, layer.owned, layer.local

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        t, e = self.tensors, layer.num_experts
        for projection, parts in (("gate_up", 2 * e), ("down", e)):
            rows, inp, first, n, cols = self._geometry(layer, projection)
            g0, groups = _group_span(t, inp, first, max(n, 1))
            shapes = {Q: ((e, rows, cols), torch.int8), SCALE: ((e, rows, groups), torch.float32),
                      ZERO: ((e, rows, groups), torch.float32), GROUPS: ((parts, cols), torch.long), SHAPE: ((0,), torch.long)}
            for role, suffix in t.names.items():
                shape, kind = shapes[role]
                loader = functools.partial(self._load, layer, projection, role, g0)
                setattr(layer, expert_name(projection, suffix), _param(torch.zeros(shape, dtype=kind), loader, parts))
            if t.regular:  # padded columns: the last group (their weights and inputs are zero)
                index = regular_groups(first, cols, t.scheme.group_size).clamp(max=groups - 1)
                layer.register_buffer(f"{projection}_group_index", index, persistent=False)
            self.kernels[projection] = _kernel(t, rows, cols, first, n)
            self.aligned[projection] = _aligned(t, cols, first, n)

    def _load(self, layer: nn.Module, projection: str, role: str, g0: int,
              param: torch.Tensor, source, name: str, part: int) -> None:
        _, inp, first, n, _ = self._geometry(layer, projection)
        if projection == "gate_up":
            expert, which = divmod(part, 2)
            dst, rows, out = layer.halves()[which], slice(layer.lo, layer.lo + layer.owned), layer.inter
        else:
            expert, dst, rows, out = part, slice(0, layer.hidden), slice(0, layer.hidden), layer.hidden
        value = self.tensors.read(role, source, name, rows, out, inp)
        if role == Q:
            param.data[expert, dst, :n] = value[:, first : first + n]
        elif role in (SCALE, ZERO):
            param.data[expert, dst] = value[:, g0 : g0 + param.shape[2]]
        elif role == GROUPS:
            param.data[part, :n] = value[first : first + n]

    def _segments(self, layer: nn.Module, projection: str, expert: int) -> Segments:
        rows = self._geometry(layer, projection)[0]
        if self.tensors.regular:
            return [(0, rows, None if self.aligned[projection] else getattr(layer, f"{projection}_group_index"))]
        groups = getattr(layer, expert_name(projection, self.tensors.names[GROUPS]))
        if projection == "down":
            return [(0, rows, groups[expert])]
        w = layer.local
        return [(0, w, groups[2 * expert]), (w, 2 * w, groups[2 * expert + 1])]

    def apply(self, layer: nn.Module, projection: str, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        names = self.tensors.names
        q, scale = (getattr(layer, expert_name(projection, names[r])) for r in (Q, SCALE))
        zero = getattr(layer, expert_name(projection, names[ZERO])) if ZERO in names else None

        def product(part: torch.Tensor, e: int) -> torch.Tensor:
            return int_linear(part, q[e], scale[e], None if zero is None else zero[e], self._segments(layer, projection, e),
                              self.kernels[projection])

        return per_expert(x, rows.sizes, product)
