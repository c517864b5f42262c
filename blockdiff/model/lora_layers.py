"""The LoRA layers: the adapter-capable layers that take the place of the base model's linear
layers and experts when LoRA is enabled (vLLM's `*WithLoRA` layers), and the pools they hold.

`enable_lora` walks a model's module tree and swaps each layer an adapter may target, found by
its type and its name, for its LoRA twin: the twin holds the base layer (`base_layer`), runs it,
and adds its pool's per-token deltas. A model built without LoRA keeps its plain layers and runs
none of this. Every LoRA layer of a model reads one `LoRAMapping`, which the model runner sets
before each forward (which adapter slot each token runs with): forwards take no adapter argument.

PEFT saves an adapter for transformers' DiffusionGemmaForBlockDiffusion, whose encoder's and
decoder's layers are separate modules that share one weight, so an adapter carries one delta for
the encoder mode (prompt chunks, committed canvases) and another for the decoder mode (canvases
being denoised). blockdiff runs both modes in one forward (encoder tokens packed first,
`num_encoder_tokens`), so each pool keeps a pair of deltas per adapter slot and applies each to its
own mode's tokens.

A linear layer's pool (`LoRALinear`) holds `slots` adapters of rank up to `max_rank`, both modes:
A [2, P*S*R, in] and B [2, out, S*R] for a layer fused from P checkpoint projections (q/k/v,
gate/up), adapter s's rows of A at p*S*R + s*R, its columns of B at s*R in part p's rows (zeros
past its rank; its scale folded into B). The segmented product is then (on the CPU) one dense
shrink x @ A^T over every slot's columns, a mask keeping each token's own slot's columns (others
exactly zero), and one expand per part @ B_p^T, added to the base layer's output: static shapes,
no host sync, and a token without an adapter gets exactly nothing added (a step none of whose rows
has an adapter sets no mapping and skips LoRA altogether). On CUDA the product is two Triton
kernels (model/lora_triton.py) in which each token reads its own adapter only. Under tensor
parallelism A and B are sharded as their base layer: column-parallel layers keep their rows of B,
row-parallel layers their columns of A, and the delta joins the base layer's partial product
before its one all-reduce.

The experts' 3-D tensors (PEFT's `target_parameters`) get a pool each (`LoRAExperts`) that runs
inside the experts' own grouped product (`Experts.run`'s deltas), only in steps where a token's
adapter targets them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from blockdiff.model.attention import AttentionMetadata
from blockdiff.model.attention_layout import ROW_ALIGN, align
from blockdiff.model.moe import Experts
from blockdiff.ops.kernels import padded
from blockdiff.ops.matmul import linear
from blockdiff.parallel.layers import ColumnParallelLinear, RowParallelLinear

try:
    from blockdiff.model.lora_triton import lora_expand, lora_shrink
except ImportError:  # no Triton: the plain torch product runs everywhere
    lora_expand = lora_shrink = None

ENCODER, DECODER = 0, 1


class LoRAError(ValueError):
    """An adapter blockdiff cannot serve (named in the message), found when it is loaded."""


@dataclass
class LoRABatch:
    """The adapters of one forward's tokens: `index` [tokens] int64, each token's adapter slot (-1:
    none; padding included), and how many tokens lead in encoder mode."""

    index: torch.Tensor
    num_encoder_tokens: int
    # whether a token's adapter targets the experts: only then do the experts' pools run (they cost
    # as much as the experts' own products at small widths)
    experts: bool = False
    mask: torch.Tensor | None = None  # [tokens, slots * rank] (`with_mask`), made once per forward

    def with_mask(self, slots: int, rank: int, dtype: torch.dtype) -> "LoRABatch":
        """The batch with its mask: 1 on the columns of each token's slot, 0 elsewhere."""
        cols = torch.arange(slots * rank, device=self.index.device) // rank
        return LoRABatch(self.index, self.num_encoder_tokens, self.experts,
                         (self.index.unsqueeze(1) == cols.unsqueeze(0)).to(dtype))

    def rows(self, start: int, end: int) -> "LoRABatch":
        """The tokens [start, end), all in one mode (the self-conditioning MLP's: decoder tokens)."""
        return LoRABatch(self.index[start:end], 0, self.experts, None if self.mask is None else self.mask[start:end])


class LoRALinear(nn.Module):
    """The LoRA pool of one linear layer (see the module's docstring)."""

    def __init__(self, parts: list[tuple[int, int, int]], in_features: int, in_local: int, in_start: int, slots: int,
                 rank: int, dtype: torch.dtype, device=None):
        """parts: the base layer's output parts, each (global rows, local rows, first global row
        owned); in_features / in_local / in_start: its input features, those this rank holds and the
        first of them (a row-parallel layer's slice; else all of them)."""
        super().__init__()
        self.parts, self.in_features, self.in_local, self.in_start = parts, in_features, in_local, in_start
        self.slots, self.rank = slots, rank
        self.offsets = [sum(p[1] for p in parts[:i]) for i in range(len(parts))]
        out = sum(p[1] for p in parts)
        self.register_buffer("a", torch.zeros(2, len(parts) * slots * rank, in_local, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(2, out, slots * rank, dtype=dtype, device=device), persistent=False)
        # each output row's part, for the Triton expand (CUDA)
        self.register_buffer("part", torch.cat([torch.full((p[1],), i, dtype=torch.int32, device=device)
                                                for i, p in enumerate(parts)]), persistent=False)

    def clear(self, slot: int) -> None:
        for p in range(len(self.parts)):
            c = (p * self.slots + slot) * self.rank
            self.a[:, c : c + self.rank] = 0
        self.b[:, :, slot * self.rank : (slot + 1) * self.rank] = 0

    def check(self, part: int, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """LoRAError unless A and B fit output part `part` (put() writes nothing before this holds)."""
        if part >= len(self.parts):
            raise LoRAError(f"the adapter targets {name}, which this checkpoint does not have (no v_proj in that layer)")
        r, global_rows = a.shape[0], self.parts[part][0]
        if r > self.rank:
            raise LoRAError(f"{name} has rank {r}, more than --max-lora-rank {self.rank}")
        if tuple(a.shape) != (r, self.in_features) or tuple(b.shape) != (global_rows, r):
            raise LoRAError(f"{name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the layer "
                            f"([r, {self.in_features}] / [{global_rows}, r])")

    def put(self, slot: int, mode: int, part: int, a: torch.Tensor, b: torch.Tensor, scale: float, name: str) -> None:
        """Adapter `slot`'s delta of `mode` for output part `part`: A [r, in], B [out, r] whole
        (this rank takes its slice), scaled by `scale`."""
        self.check(part, a, b, name)
        r = a.shape[0]
        _, local, start = self.parts[part]
        c = (part * self.slots + slot) * self.rank
        off = self.offsets[part]
        self.a[mode, c : c + r] = a[:, self.in_start : self.in_start + self.in_local].to(self.a.dtype)
        self.b[mode, off : off + local, slot * self.rank : slot * self.rank + r] = (
            b[start : start + local].float() * scale).to(self.b.dtype)

    def forward(self, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """The delta [tokens, out] of the tokens `x` [tokens, in_local]."""
        mask = batch.mask if batch.mask is not None else batch.with_mask(self.slots, self.rank, x.dtype).mask
        ne, n, index = batch.num_encoder_tokens, x.shape[0], batch.index
        if ne in (0, n):
            return self._delta(x, mask, ENCODER if ne else DECODER, index)
        # Each mode's products run over whole ROW_ALIGN groups of rows (the other mode's few rows in
        # the shared group are computed and dropped), so that a token's delta does not depend on how
        # many encoder tokens lead the step: a prompt's K/V then has the same bits whether its
        # prefix came from the cache or was computed with it.
        enc, dec = align(ne), ne - ne % ROW_ALIGN
        return torch.cat((self._delta(x[:enc], mask[:enc], ENCODER, index[:enc])[:ne],
                          self._delta(x[dec:], mask[dec:], DECODER, index[dec:].contiguous())[ne - dec:]))

    def _delta(self, x: torch.Tensor, mask: torch.Tensor, mode: int, index: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and lora_shrink is not None:  # each token reads its own adapter only (model/lora_triton.py)
            shrunk = lora_shrink(x, self.a[mode], index, len(self.parts), self.slots, self.rank)
            return lora_expand(x.new_zeros(x.shape[0], self.b.shape[1]), shrunk, self.b[mode], index, self.part, self.rank)
        shrunk = linear(x, self.a[mode])  # [n, P*S*R]: every slot's, each part's
        if len(self.parts) == 1:
            return linear(shrunk * mask, self.b[mode])
        width = self.slots * self.rank
        return torch.cat([linear(shrunk[:, p * width : (p + 1) * width] * mask, self.b[mode, off : off + part[1]])
                          for p, (part, off) in enumerate(zip(self.parts, self.offsets))], dim=-1)


class LoRAExperts(nn.Module):
    """The LoRA pool of one projection of a layer's experts (gate_up or down), both modes: A
    [E, C, in] and B [E, out, C] in the local, padded shapes of the experts' own weight
    (model/moe.py), C = the columns of 2 modes x `slots` x `rank` (padded as the grouped products
    need). Column (mode * slots + s) * rank + j is adapter slot s's j-th rank in `mode`. Every expert
    row then takes one shrink and one expand through the experts' own product (grouped or per
    expert), with a mask keeping its token's mode and slot's columns: ranks and slots of every
    adapter in one product, and no delta (exactly) for a token without an adapter.

    rows: the base weight's output rows as (first global row, first local row, count) runs;
    cols: its input columns the same way (one run). Under tensor parallelism each rank holds its
    slice of every expert's width, so gate_up keeps its rows of B and down its columns of A, and
    down's delta joins the experts' output before their one all-reduce."""

    def __init__(self, experts: int, out_local: int, in_local: int, rows: list[tuple[int, int, int]],
                 cols: tuple[int, int, int], global_shape: tuple[int, int], slots: int, rank: int, dtype: torch.dtype,
                 device=None):
        super().__init__()
        self.experts, self.rows, self.cols, self.global_shape = experts, rows, cols, global_shape
        self.slots, self.rank = slots, rank
        width = padded(2 * slots * rank, dtype)
        self.register_buffer("a", torch.zeros(experts, width, in_local, dtype=dtype, device=device), persistent=False)
        self.register_buffer("b", torch.zeros(experts, out_local, width, dtype=dtype, device=device), persistent=False)

    def clear(self, slot: int) -> None:
        for mode in (ENCODER, DECODER):
            c = (mode * self.slots + slot) * self.rank
            self.a[:, c : c + self.rank] = 0
            self.b[:, :, c : c + self.rank] = 0

    def check(self, part: int, a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        """LoRAError unless A and B fit the experts (put() writes nothing before this holds)."""
        e, (out, inp) = self.experts, self.global_shape
        r = a.shape[0] // e
        if r > self.rank:
            raise LoRAError(f"{name} has rank {r}, more than --max-lora-rank {self.rank}")
        if a.shape[0] % e or tuple(a.shape) != (e * r, inp) or tuple(b.shape) != (out, e * r):
            raise LoRAError(f"{name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the experts "
                            f"([{e} x r, {inp}] / [{out}, r x {e}])")

    def put(self, slot: int, mode: int, part: int, a: torch.Tensor, b: torch.Tensor, scale: float, name: str) -> None:
        """Adapter `slot`'s delta of `mode` as PEFT saves it for 3-D expert tensors: A [E * r, in]
        (expert e's rows e*r:(e+1)*r) and B [out, r * E] (expert e's columns e, e+E, ...), scaled by
        `scale`; this rank takes its slice."""
        self.check(part, a, b, name)
        e, (out, inp) = self.experts, self.global_shape
        r = a.shape[0] // e
        c = (mode * self.slots + slot) * self.rank
        first, local, n = self.cols
        self.a[:, c : c + r, local : local + n] = a.view(e, r, inp)[..., first : first + n].to(self.a.dtype)
        per_expert = (b.float() * scale).view(out, r, e).permute(2, 0, 1)  # [E, out, r]
        for first, local, n in self.rows:
            self.b[:, local : local + n, c : c + r] = per_expert[:, first : first + n].to(self.b.dtype)

    def mask(self, batch: LoRABatch, source: torch.Tensor) -> torch.Tensor:
        """[rows, C] of the expert rows whose tokens are `source` (model/moe.py's sorted pairs): 1 on
        the columns of each row's token's mode and adapter slot."""
        index, ne = batch.index, batch.num_encoder_tokens
        decoder = torch.arange(index.shape[0], device=index.device) >= ne
        column = torch.where(index >= 0, index + self.slots * decoder, -1).index_select(0, source)
        cols = torch.arange(self.a.shape[1], device=index.device) // self.rank
        return (column.unsqueeze(1) == cols.unsqueeze(0)).to(self.a.dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, product) -> torch.Tensor:
        """The delta [rows, out] of the expert rows x [rows, in]; `product(x, weight)` is the experts'
        own (grouped or per-expert) product of rows by [E, out, in] weights."""
        return product(product(x, self.a) * mask, self.b)


class LoRAMapping:
    """Which adapter slot each token of the next forward runs with, shared by every LoRA layer of a
    model (vLLM's punica mapping): the model runner sets it before each forward, None where no
    token has an adapter (the LoRA layers then add nothing)."""

    def __init__(self, slots: int, rank: int, dtype: torch.dtype):
        self.slots, self.rank, self.dtype = slots, rank, dtype
        self.batch: LoRABatch | None = None  # every token's
        self.decoder: LoRABatch | None = None  # the decoder tokens' (the self-conditioning MLP's rows)

    def set(self, index: torch.Tensor | None, meta: AttentionMetadata, experts: bool = False) -> None:
        """`index` [tokens of the step's rows] each token's adapter slot (-1: none; padded with -1
        up to meta.num_tokens), or None: no adapter this forward. `experts`: whether one of the
        adapters targets the experts (only then do the experts' pools run)."""
        if index is None:
            self.batch = self.decoder = None
            return
        if meta.num_tokens > index.shape[0]:
            index = torch.cat((index, index.new_full((meta.num_tokens - index.shape[0],), -1)))
        ne = meta.num_encoder_tokens
        self.batch = LoRABatch(index, ne, experts).with_mask(self.slots, self.rank, self.dtype)
        self.decoder = self.batch.rows(ne, ne + meta.num_decoder_tokens)


class _LoRALayer(nn.Module):
    """A base layer and its pool(s), reading the model's mapping. Attributes it lacks are its base
    layer's (its weights, shapes and quantization method), as the base layer it replaced had them."""

    def __init__(self, base_layer: nn.Module, mapping: LoRAMapping, decoder_rows: bool):
        super().__init__()
        self.base_layer, self.mapping, self.decoder_rows = base_layer, mapping, decoder_rows

    def active(self) -> LoRABatch | None:
        """This forward's tokens' adapters, or None."""
        return self.mapping.decoder if self.decoder_rows else self.mapping.batch

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self._modules.get("base_layer")
            if base is None:
                raise
            return getattr(base, name)


class ColumnParallelLinearWithLoRA(_LoRALayer):
    def __init__(self, base_layer: ColumnParallelLinear, mapping: LoRAMapping, decoder_rows: bool = False):
        super().__init__(base_layer, mapping, decoder_rows)
        weight = base_layer.weight
        self.lora = LoRALinear(base_layer.parts, base_layer.in_features, base_layer.in_features, 0, mapping.slots,
                               mapping.rank, mapping.dtype, weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        batch = self.active()
        return y if batch is None else y + self.lora(x, batch)


class RowParallelLinearWithLoRA(_LoRALayer):
    """The delta of this rank's A slice joins the base layer's partial product before its one all-reduce."""

    def __init__(self, base_layer: RowParallelLinear, mapping: LoRAMapping, decoder_rows: bool = False):
        super().__init__(base_layer, mapping, decoder_rows)
        rows, local = base_layer.weight.shape[0], base_layer.local_in
        self.lora = LoRALinear([(rows, rows, 0)], base_layer.in_features, local, base_layer.group.rank * local,
                               mapping.slots, mapping.rank, mapping.dtype, base_layer.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer.partial(x)
        batch = self.active()
        return self.base_layer.reduced(y if batch is None else y + self.lora(x, batch))


class ExpertsWithLoRA(_LoRALayer):
    """A layer's experts with a pool for each of gate_up and down (unquantized experts only)."""

    def __init__(self, base_layer: Experts, mapping: LoRAMapping, decoder_rows: bool = False):
        super().__init__(base_layer, mapping, decoder_rows)
        ex, slots, rank, dtype = base_layer, mapping.slots, mapping.rank, mapping.dtype
        e, h, i, lo, n, w = ex.num_experts, ex.hidden, ex.inter, ex.lo, ex.owned, ex.local
        device = ex.gate_up.device
        self.lora_gate_up = LoRAExperts(e, 2 * w, ex.hidden_in, [(lo, 0, n), (i + lo, w, n)], (0, 0, h), (2 * i, h),
                                        slots, rank, dtype, device)
        self.lora_down = LoRAExperts(e, ex.hidden_in, w, [(0, 0, h)], (lo, 0, n), (h, i), slots, rank, dtype, device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        batch = self.active()
        if batch is None or not batch.experts:
            return self.base_layer(x, weights, index)
        return self.base_layer.run(x, weights, index, lambda source: self.deltas(self.lora_gate_up.mask(batch, source)))

    def deltas(self, mask: torch.Tensor) -> "_ExpertDeltas":
        """The pools' deltas of the sorted expert rows whose adapter columns are `mask` (LoRAExperts.mask)."""
        return _ExpertDeltas(self.lora_gate_up, self.lora_down, mask)


@dataclass
class _ExpertDeltas:
    """model/moe.py RowDeltas: the pools' deltas of the rows, each product over as many rows as it is given."""

    gate_up_pool: LoRAExperts
    down_pool: LoRAExperts
    mask: torch.Tensor

    def gate_up(self, xs: torch.Tensor, product) -> torch.Tensor:
        return self.gate_up_pool(xs, self.mask[: xs.shape[0]], product)

    def down(self, act: torch.Tensor, product) -> torch.Tensor:
        return self.down_pool(act, self.mask[: act.shape[0]], product)


# ---- which layers are replaced ----------------------------------------------------------------------

# A layer is replaced where its type has a LoRA twin and its name in the module tree is one an
# adapter may target (model/lora.py `place` maps PEFT's names onto these): the decoder layers'
# attention projections, dense MLPs and experts, and the self-conditioning MLP, which runs on the
# decoder tokens only. Other layers of those types (a vision tower's) keep theirs.
LORA_LAYERS = {ColumnParallelLinear: ColumnParallelLinearWithLoRA, RowParallelLinear: RowParallelLinearWithLoRA,
               Experts: ExpertsWithLoRA}
_TARGET = re.compile(r"layers\.\d+\.(attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj|experts)|self_conditioning\.mlp\.(gate_up|down)_proj")
_DECODER_ROWS = "self_conditioning."


def enable_lora(model: nn.Module, slots: int, rank: int) -> LoRAMapping:
    """Swaps every layer of `model` an adapter may target for its LoRA twin, holding a pool of
    `slots` adapters of rank <= `rank`; -> the mapping they all read."""
    mapping = LoRAMapping(slots, rank, model.dtype)
    for name, layer in list(model.named_modules()):
        twin = LORA_LAYERS.get(type(layer))
        if twin is None or not _TARGET.fullmatch(name):
            continue
        if isinstance(layer, Experts):
            dtype = layer.shape.weight_dtype
        else:  # integer formats keep their weights under their own names
            dtype = layer.weight.dtype if hasattr(layer, "weight") else None
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise LoRAError(f"LoRA on a quantized layer ({name}: {dtype or 'integer weights'}) is not supported")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, twin(layer, mapping, name.startswith(_DECODER_ROWS)))
    return mapping
