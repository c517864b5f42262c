"""Linear and embedding layers split over the tensor-parallel group.

At group size 1 each layer is exactly its plain counterpart: one `linear` (blockdiff/ops/matmul.py) or `F.embedding`,
no slicing, no collective. Each parameter carries a `weight_loader(param, source, name, *part)` that
takes this rank's slice out of a checkpoint tensor (a safetensors slice or a tensor), after checking
the full tensor's shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.ops.fp8 import FP8, fp8_linear, sharded_token_scales
from blockdiff.ops.matmul import linear
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard
from blockdiff.quantization import Fp8Config


class ShapeMismatch(ValueError):
    pass


def source_shape(source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def check_shape(name: str, source, expected: Sequence[int]) -> None:
    shape = source_shape(source)
    if shape != tuple(expected):
        raise ShapeMismatch(f"tensor {name!r} has shape {list(shape)}, expected {list(expected)}")


def copy_into(dst: torch.Tensor, src) -> None:
    src = src if isinstance(src, torch.Tensor) else torch.as_tensor(src)
    dst.copy_(src.to(dtype=dst.dtype))


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


def _fp8_params(module: nn.Module, quant: Fp8Config, rows: int, num_parts: int) -> None:
    """FP8 companions of module.weight: float32 scales per row and, for static activations, the input scale."""
    module.activations = quant.activations
    module.weight_scale = nn.Parameter(torch.empty(rows, 1), requires_grad=False)
    module.weight_scale.num_parts = num_parts
    module.input_scale = None
    if quant.activations == "static":
        module.input_scale = nn.Parameter(torch.zeros(1), requires_grad=False)
        module.input_scale.weight_loader = load_input_scale
        module.input_scale.num_parts = num_parts


def replicated_loader(param: torch.Tensor, source, name: str) -> None:
    check_shape(name, source, param.shape)
    copy_into(param.data, source[:])


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T where W stacks several parts ("q", "k", ... or "gate", "up"), each split by rows.

    `parts` gives, per part, (global rows, local rows, first global row owned by this rank), so a
    part can be split evenly or replicated in blocks (KV heads when ranks outnumber them).
    """

    def __init__(self, in_features: int, parts: Sequence[tuple[int, int, int]], dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.parts = list(parts)
        self.offsets = [sum(p[1] for p in self.parts[:i]) for i in range(len(self.parts))]
        self.weight = nn.Parameter(torch.empty(sum(p[1] for p in self.parts), in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load_part
        self.weight.num_parts = len(self.parts)

    @staticmethod
    def even_part(global_rows: int, group: TPGroup) -> tuple[int, int, int]:
        if global_rows % group.size:
            raise ValueError(f"{global_rows} rows cannot be split over {group.size} ranks")
        local = global_rows // group.size
        return global_rows, local, group.rank * local

    def load_part(self, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        global_rows, local, start = self.parts[part]
        check_shape(name, source, (global_rows, self.in_features))
        off = self.offsets[part]
        copy_into(param.data[off : off + local], source[start : start + local])

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """lora: the forward's adapters (model/lora.py LoRABatch), added where this layer has a pool."""
        y = linear(x, self.weight)
        pool = self._modules.get("lora")  # a LoRA pool (model/lora.py enable_lora): only with --enable-lora
        if lora is not None and pool is not None:
            y = y + pool(x, lora)
        return y


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with FP8 weights; each part's scales are sliced with its rows."""

    def __init__(self, in_features: int, parts: Sequence[tuple[int, int, int]], quant: Fp8Config):
        super().__init__(in_features, parts, dtype=FP8)
        _fp8_params(self, quant, self.weight.shape[0], len(self.parts))
        self.weight_scale.weight_loader = self.load_scale

    def load_part(self, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        check_fp8(name, source)
        super().load_part(param, source, name, part)

    def load_scale(self, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        global_rows, local, start = self.parts[part]
        off = self.offsets[part]
        load_scale(param.data[off : off + local], source, name, global_rows, start, local)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # no LoRA pool on FP8 layers (model/lora.py)
        return fp8_linear(x, self.weight, self.weight_scale, self.activations, self.input_scale)


class RowParallelLinear(nn.Module):
    """y = x @ W.T with W split by columns: each rank holds a slice of the input features, and one
    all-reduce sums the partial products."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, dtype: torch.dtype | None = None):
        super().__init__()
        if in_features % group.size:
            raise ValueError(f"{in_features} input features cannot be split over {group.size} ranks")
        self.group = group
        self.reduce = group.size > 1
        self.in_features = in_features
        self.local_in = in_features // group.size
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: torch.Tensor, source, name: str) -> None:
        check_shape(name, source, (param.shape[0], self.in_features))
        start = self.group.rank * self.local_in
        copy_into(param.data, source[:, start : start + self.local_in])

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """lora: as ColumnParallelLinear's; the delta of this rank's A slice joins the partial
        product before the one all-reduce."""
        y = linear(x, self.weight)
        pool = self._modules.get("lora")  # a LoRA pool (model/lora.py enable_lora): only with --enable-lora
        if lora is not None and pool is not None:
            y = y + pool(x, lora)
        if self.reduce:
            self.group.all_reduce(y)
        return y


class Fp8RowParallelLinear(RowParallelLinear):
    """RowParallelLinear with FP8 weights: every rank keeps all output rows' scales."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, quant: Fp8Config):
        super().__init__(in_features, out_features, group, dtype=FP8)
        _fp8_params(self, quant, out_features, 1)
        self.weight_scale.weight_loader = self.load_scale

    def load(self, param: torch.Tensor, source, name: str) -> None:
        check_fp8(name, source)
        super().load(param, source, name)

    def load_scale(self, param: torch.Tensor, source, name: str) -> None:
        load_scale(param.data, source, name, param.shape[0], 0, param.shape[0])

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:  # no LoRA pool on FP8 layers (model/lora.py)
        scales = sharded_token_scales(x, self.group) if self.reduce and self.activations == "dynamic" else None
        y = fp8_linear(x, self.weight, self.weight_scale, self.activations, self.input_scale, scales)
        if self.reduce:
            self.group.all_reduce(y)
        return y


def column_parallel(in_features: int, parts, dtype: torch.dtype, quant: Fp8Config | None) -> ColumnParallelLinear:
    if quant is None:
        return ColumnParallelLinear(in_features, parts, dtype=dtype)
    return Fp8ColumnParallelLinear(in_features, parts, quant)


def row_parallel(in_features: int, out_features: int, group: TPGroup, dtype: torch.dtype, quant: Fp8Config | None) -> RowParallelLinear:
    if quant is None:
        return RowParallelLinear(in_features, out_features, group, dtype=dtype)
    return Fp8RowParallelLinear(in_features, out_features, group, quant)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split by `VocabShard`; also serves as the tied LM head.

    Embedding lookups of tokens owned by other ranks contribute zero and one all-reduce completes
    them. The LM head returns this rank's logits only: [tokens, shard.local_rows].
    """

    def __init__(self, shard: VocabShard, hidden: int, group: TPGroup, scale: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.shard = shard
        self.group = group
        self.sharded = group.size > 1
        self.scale = scale
        self.weight = nn.Parameter(torch.empty(shard.local_rows, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: torch.Tensor, source, name: str) -> None:
        check_shape(name, source, (self.shard.vocab_size, param.shape[1]))
        if not self.sharded:
            copy_into(param.data, source[:])
            return
        s = self.shard
        param.data.zero_()
        copy_into(param.data[: s.num_org], source[s.org_start : s.org_end])
        if s.num_added:
            copy_into(param.data[s.org_rows : s.org_rows + s.num_added], source[s.added_start : s.added_end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(ids, self.weight) * self.scale
        local, owned = self.shard.to_local(ids)
        out = F.embedding(local, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        self.group.all_reduce(out)
        return out * self.scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)
