"""Linear and embedding layers split over the tensor-parallel group.

At group size 1 each layer is exactly its plain counterpart: one `linear` (blockdiff/ops/matmul.py) or `F.embedding`,
no slicing, no collective. Each parameter carries a `weight_loader(param, source, name, *part)` that
takes this rank's slice out of a checkpoint tensor (a safetensors slice or a tensor), after checking
the full tensor's shape. A linear layer's weights (their dtype, companions such as scales, the
product) are its quantization method's (blockdiff/parallel/quantization/); the layer keeps which
rows and columns this rank holds (`output_rows`, `load_weight`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.ops.matmul import linear
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.quantization.base import UNQUANTIZED_LINEAR, LinearMethod
from blockdiff.parallel.vocab import VocabShard


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


def replicated_loader(param: torch.Tensor, source, name: str) -> None:
    check_shape(name, source, param.shape)
    copy_into(param.data, source[:])


class ReplicatedLinear(nn.Module):
    """y = x @ W.T with the whole of W on every rank (the routers)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None,
                 method: LinearMethod = UNQUANTIZED_LINEAR):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.num_parts = 1
        self.method = method
        method.create_weights(self, out_features, in_features, dtype)

    def output_rows(self, part: int = 0) -> tuple[int, int, int, int]:
        """As ColumnParallelLinear's: every rank holds all output rows."""
        return self.out_features, self.out_features, 0, 0

    def load_weight(self, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        replicated_loader(param, source, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T where W stacks several parts ("q", "k", ... or "gate", "up"), each split by rows.

    `parts` gives, per part, (global rows, local rows, first global row owned by this rank), so a
    part can be split evenly or replicated in blocks (KV heads when ranks outnumber them).
    """

    def __init__(self, in_features: int, parts: Sequence[tuple[int, int, int]], dtype: torch.dtype | None = None,
                 method: LinearMethod = UNQUANTIZED_LINEAR):
        super().__init__()
        self.in_features = in_features
        self.parts = list(parts)
        self.num_parts = len(self.parts)
        self.offsets = [sum(p[1] for p in self.parts[:i]) for i in range(len(self.parts))]
        self.method = method
        method.create_weights(self, sum(p[1] for p in self.parts), in_features, dtype)

    @staticmethod
    def even_part(global_rows: int, group: TPGroup) -> tuple[int, int, int]:
        if global_rows % group.size:
            raise ValueError(f"{global_rows} rows cannot be split over {group.size} ranks")
        local = global_rows // group.size
        return global_rows, local, group.rank * local

    def output_rows(self, part: int = 0) -> tuple[int, int, int, int]:
        """part -> (its rows in the checkpoint, how many this rank holds, the first of them, where they start here)."""
        global_rows, local, start = self.parts[part]
        return global_rows, local, start, self.offsets[part]

    def load_weight(self, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        global_rows, local, start, off = self.output_rows(part)
        check_shape(name, source, (global_rows, self.in_features))
        copy_into(param.data[off : off + local], source[start : start + local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class RowParallelLinear(nn.Module):
    """y = x @ W.T with W split by columns: each rank holds a slice of the input features, and one
    all-reduce sums the partial products."""

    def __init__(self, in_features: int, out_features: int, group: TPGroup, dtype: torch.dtype | None = None,
                 method: LinearMethod = UNQUANTIZED_LINEAR):
        super().__init__()
        if in_features % group.size:
            raise ValueError(f"{in_features} input features cannot be split over {group.size} ranks")
        self.group = group
        self.reduce = group.size > 1
        self.in_features = in_features
        self.out_features = out_features
        self.num_parts = 1
        self.local_in = in_features // group.size
        self.method = method
        method.create_weights(self, out_features, self.local_in, dtype)

    def output_rows(self, part: int = 0) -> tuple[int, int, int, int]:
        """As ColumnParallelLinear's: every rank holds all output rows."""
        return self.out_features, self.out_features, 0, 0

    def load_weight(self, param: torch.Tensor, source, name: str, part: int = 0) -> None:
        check_shape(name, source, (param.shape[0], self.in_features))
        start = self.group.rank * self.local_in
        copy_into(param.data, source[:, start : start + self.local_in])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduced(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product (its slice of the input features)."""
        return self.method.apply(self, x)

    def reduced(self, y: torch.Tensor) -> torch.Tensor:
        """The sum over the group of the partial products `y` (in place): a layer that wraps this one
        adds its own partial terms to `partial`'s before this one all-reduce."""
        if self.reduce:
            self.group.all_reduce(y)
        return y


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
