"""Feed-forward blocks: the dense gated MLP and the mixture of experts that runs beside it.

Under tensor parallelism both are split along their intermediate dimension (every rank holds every
expert, with 1/N of each expert's width), so routing stays replicated, no tokens move between
ranks, and one all-reduce ends each block. At DiffusionGemma's size this keeps all ranks equally
loaded whatever the router does; docs/tp.md has the measurements.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.model.gemma_config import GemmaConfig
from blockdiff.ops.kernels import (
    BATCH_TILE, BATCHED, PER_EXPERT, ExpertRows, ExpertShape, batched_rows, expert_linear, kernel_on, padded,
)
from blockdiff.model.attention import ROW_ALIGN
from blockdiff.model.layers import RMSNorm, activation
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, check_shape, copy_into
from blockdiff.parallel.quantization.base import (
    UNQUANTIZED_EXPERTS, ExpertsMethod, QuantConfig, QuantizationError, experts_method, linear_method,
)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused in one column-parallel matmul."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        group: TPGroup,
        dtype: torch.dtype,
        quant: QuantConfig | None = None,
        prefix: str = "",
    ):
        """`quant` and `prefix` (the checkpoint's name of this module) decide which products are quantized."""
        super().__init__()
        part = ColumnParallelLinear.even_part(intermediate, group)
        self.local = part[1]
        gate_up = linear_method(quant, f"{prefix}.gate_proj", f"{prefix}.up_proj")
        self.gate_up_proj = ColumnParallelLinear(hidden, [part, part], dtype, gate_up)
        self.down_proj = RowParallelLinear(intermediate, hidden, group, dtype, linear_method(quant, f"{prefix}.down_proj"))
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.local, dim=-1)
        return self.down_proj(self.act(gate) * up)


class RowDeltas(Protocol):
    """Additions to the experts' two products over the sorted expert rows of one forward (an
    adapter layer that wraps the experts gives them: `Experts.run`). `product(x, weight)` is the
    experts' own (grouped or per-expert) product of rows by [E, out, in] weights."""

    def gate_up(self, xs: torch.Tensor, product: Callable) -> torch.Tensor: ...

    def down(self, act: torch.Tensor, product: Callable) -> torch.Tensor: ...


class Router(nn.Module):
    def __init__(self, config: GemmaConfig, dtype: torch.dtype, prefix: str):
        super().__init__()
        if config.quantization is not None and config.quantization.linear_method(f"{prefix}.proj") is not None:
            raise QuantizationError(f"quantization_config quantizes the router {prefix}.proj; blockdiff runs routers unquantized")
        h, e = config.hidden_size, config.num_experts
        self.top_k = config.top_k_experts
        self.norm = RMSNorm(h, config.rms_norm_eps, with_scale=False)
        self.root = h**-0.5
        self.proj = ReplicatedLinear(h, e, dtype)
        self.scale = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(e, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [tokens, k] float32, expert index [tokens, k])."""
        return self.route(self.norm(x))

    def route(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward from the router's norm of x (`normed`, in x's dtype)."""
        scores = self.proj(normed * self.scale * self.root)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[index], index


class Experts(nn.Module):
    """Experts stored as 3-D tensors like the checkpoint: gate_up [E, 2W, H'], down [E, H', W].

    Each rank owns `owned` of every expert's `moe_intermediate_size` columns (ceil(I / ranks); the
    last ranks may own fewer), stored in a width W padded to what the grouped kernels accept
    (blockdiff/ops/kernels.py), and H' is the hidden size padded the same way. The padding is zeros:
    zero rows of gate/up give activations gelu(0) * 0 = 0, zero columns of down add nothing, and the
    input's padded columns are zero, so every product equals the unpadded one. The weights, their
    loaders and products are the quantization method's (blockdiff/parallel/quantization/)."""

    def __init__(self, config: GemmaConfig, group: TPGroup, dtype: torch.dtype, method: ExpertsMethod = UNQUANTIZED_EXPERTS):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden, self.inter = e, h, i
        share = -(-i // group.size)
        self.lo = min(group.rank * share, i)  # this rank's first column of every expert's intermediate dimension
        self.owned = min(self.lo + share, i) - self.lo
        weights = method.weight_dtype(dtype)
        self.local = padded(share, weights)
        self.hidden_in = padded(h, weights)
        self.rank = group.rank
        self.group = group
        self.reduce = group.size > 1
        self.act = activation(config.hidden_activation)
        # what blockdiff/ops/kernels.py decides on
        self.shape = ExpertShape(self.hidden_in, self.local, weights, method.activations)
        self.method = method
        method.create_weights(self, dtype)

    def halves(self) -> tuple[slice, slice]:
        """The rows of gate_up that hold this rank's gate and up columns."""
        return slice(0, self.owned), slice(self.local, self.local + self.owned)

    def load_gate_up(self, param: torch.Tensor, source, name: str) -> None:
        check_shape(name, source, (self.num_experts, 2 * self.inter, self.hidden))
        lo, n, h = self.lo, self.owned, self.hidden
        gate, up = self.halves()
        copy_into(param.data[:, gate, :h], source[:, lo : lo + n])
        copy_into(param.data[:, up, :h], source[:, self.inter + lo : self.inter + lo + n])

    def load_down(self, param: torch.Tensor, source, name: str) -> None:
        check_shape(name, source, (self.num_experts, self.hidden, self.inter))
        copy_into(param.data[:, : self.hidden, : self.owned], source[:, :, self.lo : self.lo + self.owned])

    @torch.no_grad()
    def zero_padding(self) -> None:
        """Zero the padded rows and columns again (after the dummy loader filled every entry)."""
        n, w, h = self.owned, self.local, self.hidden
        for p in (self.gate_up.data[:, n:w], self.gate_up.data[:, w + n :], self.gate_up.data[..., h:],
                  self.down.data[:, h:], self.down.data[..., n:]):
            p.zero_()

    def checkpoint_tensor(self, name: str) -> torch.Tensor:
        """The checkpoint's tensor of `name` ("gate_up" or "down") without the padding; one rank only."""
        h, n = self.hidden, self.owned
        if name == "down":
            return self.down.data[:, :h, :n]
        gate, up = self.halves()
        return torch.cat((self.gate_up.data[:, gate, :h], self.gate_up.data[:, up, :h]), dim=1)

    def kernel(self, x: torch.Tensor) -> str:
        """The products' kernel for x (blockdiff/ops/kernels.py): grouped wherever torch runs them
        without a host sync; on this CPU they measured faster than per-expert oneDNN products in
        float32 as well (docs/benchmarks.md, "MoE: grouped against per-expert products")."""
        return kernel_on(x.device, x.dtype, self.shape)

    def grouped(self, x: torch.Tensor) -> bool:
        return self.kernel(x) != PER_EXPERT

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.run(x, weights, index)

    def run(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
            deltas: Callable[[torch.Tensor], RowDeltas] | None = None) -> torch.Tensor:
        """Tokens are sorted by expert into one buffer where each expert's rows start on a multiple
        of ROW_ALIGN, with no padding to the busiest expert's load. The buffer has a fixed size (the
        pairs plus every expert's worst alignment gap) and the offsets stay on the device, so the
        grouped path has static shapes and no host sync; the per-expert path reads the row counts.
        deltas: given the buffer's rows' tokens, what to add to the two products (an adapter layer
        wrapping the experts: they then run the grouped or per-expert products)."""
        n, k = index.shape
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // k
        ranked = flat.index_select(0, order)  # the pairs' experts, ascending
        experts = torch.arange(self.num_experts, device=x.device)
        counts = torch.searchsorted(ranked, experts, right=True).diff(prepend=experts[:1] * 0)
        if self.hidden_in != self.hidden:  # zero columns for the padded weights (blockdiff/ops/kernels.py)
            x = F.pad(x, (0, self.hidden_in - self.hidden))
        kernel = self.kernel(x)
        batched = self._batched(x, ranked, counts, token) if kernel == BATCHED and deltas is None else None
        if batched is not None:
            y, dest = batched
        else:
            rows = (counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
            ends = rows.cumsum(0)
            skip = (ends - rows) - (counts.cumsum(0) - counts)  # per expert: aligned start - packed start
            dest = torch.arange(n * k, device=x.device) + skip[ranked]
            capacity = n * k + self.num_experts * (ROW_ALIGN - 1)
            # Row gathers through index_select (a copy per row) rather than advanced indexing (index
            # arithmetic per element, ~5x slower on CPU); gap rows repeat token 0 and are dropped.
            source = torch.zeros(capacity, dtype=torch.long, device=x.device).index_copy_(0, dest, token)
            xs = x.index_select(0, source)
            added = None if deltas is None else deltas(source)
            if kernel != PER_EXPERT:
                y = self._grouped(xs, ends.to(torch.int32), added, counts.to(torch.int32))
            else:
                y = self._per_expert(xs, rows.tolist(), added)
        y = (y[:, : self.hidden].index_select(0, dest) * weights.reshape(-1)[order, None]).to(x.dtype)
        out = combine_top_k(y, order, n, k)
        if self.reduce:
            self.group.all_reduce(out)
        return out

    def _batched(self, x: torch.Tensor, ranked: torch.Tensor, counts: torch.Tensor,
                 token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts as one torch.bmm per projection (kernels.BATCHED): expert e's tokens are rows
        e * cap ... of one [E, cap, hidden] buffer, cap the busiest expert's count rounded up to
        BATCH_TILE rows, read on the host (free on the CPU; traced code takes the static bound, n
        rows each). -> (the rows' outputs, each pair's row), or None where that padding would exceed
        kernels.BATCH_MAX_PADDING: the caller runs the grouped products then. Padding rows repeat
        token 0 and are dropped."""
        e, pairs = self.num_experts, ranked.shape[0]
        n = x.shape[0]
        if torch.compiler.is_compiling():
            cap = -(-n // BATCH_TILE) * BATCH_TILE
        else:
            cap = batched_rows(int(counts.max()), pairs, e)
            if cap is None:
                return None
        dest = ranked * cap + torch.arange(pairs, device=x.device) - (counts.cumsum(0) - counts).index_select(0, ranked)
        source = torch.zeros(e * cap, dtype=torch.long, device=x.device).index_copy_(0, dest, token)
        return self._mlp(x.index_select(0, source), ExpertRows(experts=e)), dest

    def _grouped(self, xs: torch.Tensor, ends: torch.Tensor, deltas: RowDeltas | None = None,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        """Both products of every expert as one grouped call each (groups end at `ends` and begin
        with `counts` rows of tokens, int32; None: every row is a token's)."""
        return self._mlp(xs, ExpertRows(ends=ends, counts=counts), deltas)

    def _per_expert(self, xs: torch.Tensor, sizes: list[int], deltas: RowDeltas | None = None) -> torch.Tensor:
        """Two products per busy expert over its own rows (the first sum(sizes) rows of xs; the
        deltas read as many of their rows)."""
        return self._mlp(xs[: sum(sizes)], ExpertRows(sizes=sizes), deltas)

    def _mlp(self, xs: torch.Tensor, rows: ExpertRows, deltas: RowDeltas | None = None) -> torch.Tensor:
        """down(act(gate(xs)) * up(xs)) of the rows, laid out as `rows` says, by the quantization
        method, plus `deltas` where given."""
        def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return expert_linear(x, weight, rows)

        hidden = self.method.apply(self, "gate_up", xs, rows)
        if deltas is not None:
            hidden = hidden + deltas.gate_up(xs, product)
        gate, up = hidden.split(self.local, dim=-1)
        act = self.act(gate) * up
        out = self.method.apply(self, "down", act, rows)
        return out if deltas is None else out + deltas.down(act, product)


def make_experts(config: GemmaConfig, group: TPGroup, dtype: torch.dtype, prefix: str) -> Experts:
    names = [f"{prefix}.{e}.{p}" for e in range(config.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    return Experts(config, group, dtype, experts_method(config.quantization, *names))


def combine_top_k(y: torch.Tensor, order: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[n, hidden] each token's k expert outputs (the rows of y [n * k, hidden], pair order[j] at
    row j) added in float32 from zero in ascending expert order, then rounded to y's dtype once.
    That is how an index_add_ over the rows adds them on the CPU, so the bits are the same; but
    index_add_ adds with atomics on CUDA, in whatever order the threads arrive, and a token's sum
    (so its tokens) would change with its batch. Here every device adds in one fixed order."""
    rows = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=order.device))
    # A token's pairs are sorted by expert in `order`: its rows in ascending order are its experts'.
    parts = y.index_select(0, rows.view(n, k).sort(dim=1).values.reshape(-1)).view(n, k, -1)
    out = parts.new_zeros(n, y.shape[1], dtype=torch.float32)
    for i in range(k):
        out = out + parts[:, i]
    return out.to(y.dtype)
