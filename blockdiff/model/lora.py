"""LoRA adapters in PEFT's format, applied per token without merging (docs/lora.md).

An adapter is PEFT's `adapter_config.json` and `adapter_model.safetensors`, saved for transformers'
DiffusionGemmaForBlockDiffusion. There the encoder's and the decoder's layers are separate modules
that share one weight, so PEFT wraps each and an adapter carries one delta for the encoder mode
(prompt chunks, committed canvases) and another for the decoder mode (canvases being denoised).
blockdiff runs both modes in one forward (encoder tokens packed first, `num_encoder_tokens`), so
each LoRA layer keeps a pair of deltas per adapter slot and applies each to its own mode's tokens.

Every linear an adapter may target gets a `LoRALinear` holding a fixed pool of `slots` adapters of
rank up to `max_rank`, both modes: A [2, P*S*R, in] and B [2, out, S*R] for a layer fused from P
checkpoint projections (q/k/v, gate/up), adapter s's rows of A at p*S*R + s*R, its columns of B at
s*R in part p's rows (zeros past its rank; its scale folded into B). A forward's tokens name their
adapter slot (`LoRABatch.index`, -1: none); the segmented product is then (on the CPU) one dense
shrink x @ A^T over every slot's columns, a mask keeping each token's own slot's columns (others
exactly zero), and one expand per part @ B_p^T, added to the base layer's output: static shapes, no host sync, and
a token without an adapter gets exactly nothing added (a step none of whose rows has an adapter
skips LoRA altogether: worker/request_slots.py). On CUDA the product is two Triton kernels
(ops/triton_lora.py) in which each token reads its own adapter only. Under tensor parallelism A and
B are sharded as their base layer: column-parallel layers keep their rows of B, row-parallel layers
their columns of A, and the delta joins the base layer's partial product before its one all-reduce.

The experts' 3-D tensors (PEFT's `target_parameters`) get a pool each (`LoRAExperts`) that runs
inside the experts' own grouped product, only in steps where a token's adapter targets them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from blockdiff.model.attention_layout import ROW_ALIGN, align
from blockdiff.ops.kernels import padded
from blockdiff.ops.matmul import linear

try:
    from blockdiff.ops.triton_lora import lora_expand, lora_shrink
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
        if x.is_cuda and lora_shrink is not None:  # each token reads its own adapter only (ops/triton_lora.py)
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


# ---- where PEFT's names go -------------------------------------------------------------------------

# transformers' module names (as PEFT saves them, after "base_model.model.") -> (mode, layer or None
# for the self-conditioning MLP, what in blockdiff, which part of it).
_LAYER = re.compile(r"model\.(encoder\.language_model|decoder)\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")
_SELF_COND = re.compile(r"model\.decoder\.self_conditioning\.(gate|up|down)_proj$")
_PARTS = {"q": ("qkv_proj", 0), "k": ("qkv_proj", 1), "v": ("qkv_proj", 2), "o": ("o_proj", 0),
          "gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", 0)}


_EXPERTS = re.compile(r"model\.(encoder\.language_model|decoder)\.layers\.(\d+)\.experts((?:\.base_layer)*)$")
# transformers' experts register gate_up_proj first; PEFT wraps a module's targeted parameters in
# that order, the first innermost (saved as experts.base_layer.lora_A when both are targeted)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def lora_pools(model: nn.Module) -> dict[tuple[int, str, str], nn.Module]:
    """The LoRA pools of `model` (a DiffusionGemma with enable_lora) by (layer or -1 for the
    self-conditioning MLP, "self_attn" / "mlp" / "experts", the blockdiff linear's or the expert
    tensor's name)."""
    out = {}
    for i, block in enumerate(model.layers):
        out[(i, "self_attn", "qkv_proj")] = block.attn.qkv_proj.lora
        out[(i, "self_attn", "o_proj")] = block.attn.o_proj.lora
        out[(i, "mlp", "gate_up_proj")] = block.mlp.gate_up_proj.lora
        out[(i, "mlp", "down_proj")] = block.mlp.down_proj.lora
        out[(i, "experts", "gate_up_proj")] = block.experts.lora_gate_up
        out[(i, "experts", "down_proj")] = block.experts.lora_down
    mlp = model.self_conditioning.mlp
    out[(-1, "mlp", "gate_up_proj")] = mlp.gate_up_proj.lora
    out[(-1, "mlp", "down_proj")] = mlp.down_proj.lora
    return out


def place(module: str, expert_params: list[str] | None = None) -> tuple[int, tuple[int, str, str], int]:
    """(mode, lora_pools key, part) of a transformers module name; LoRAError for one blockdiff cannot
    apply. expert_params: the expert tensors the adapter targets (PEFT's target_parameters)."""
    m = _LAYER.search(module)
    if m:
        mode = ENCODER if m.group(1).startswith("encoder") else DECODER
        name, part = _PARTS[m.group(4)]
        if m.group(3) == "self_attn" and m.group(4) in ("gate", "up", "down") or m.group(3) == "mlp" and m.group(4) in "qkvo":
            raise LoRAError(f"the adapter targets {module}, which blockdiff cannot apply")
        return mode, (int(m.group(2)), m.group(3), name), part
    m = _SELF_COND.search(module)
    if m:
        name, part = _PARTS[m.group(1)]
        return DECODER, (-1, "mlp", name), part
    m = _EXPERTS.search(module)
    if m and expert_params:
        depth = m.group(3).count("base_layer")
        if depth >= len(expert_params):
            raise LoRAError(f"the adapter has {module}, more nested than its target_parameters {expert_params}")
        mode = ENCODER if m.group(1).startswith("encoder") else DECODER
        return mode, (int(m.group(2)), "experts", expert_params[len(expert_params) - 1 - depth]), 0
    raise LoRAError(f"the adapter targets {module}, which blockdiff cannot apply (blockdiff applies LoRA to the "
                    "attention projections, the dense MLP, the experts and the self-conditioning MLP)")


def enable_lora(model: nn.Module, slots: int, rank: int) -> None:
    """Gives every linear and expert tensor an adapter may target a pool of `slots` adapters of rank <= `rank`."""
    from blockdiff.parallel.layers import ColumnParallelLinear, RowParallelLinear

    group = model.group
    for layer in [m for block in model.layers for m in (block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj,
                                                        block.mlp.down_proj)] + [model.self_conditioning.mlp.gate_up_proj,
                                                                                 model.self_conditioning.mlp.down_proj]:
        weight = getattr(layer, "weight", None)  # integer layers keep theirs under their format's names
        if weight is None or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise LoRAError(f"LoRA on a quantized layer ({'integer' if weight is None else weight.dtype}) is not supported")
        if isinstance(layer, RowParallelLinear):
            start = group.rank * layer.local_in
            pool = LoRALinear([(weight.shape[0], weight.shape[0], 0)], layer.in_features, layer.local_in, start, slots,
                              rank, model.dtype, weight.device)
        else:
            assert isinstance(layer, ColumnParallelLinear)
            pool = LoRALinear(layer.parts, layer.in_features, layer.in_features, 0, slots, rank, model.dtype, weight.device)
        layer.lora = pool
    for block in model.layers:
        enable_expert_lora(block.experts, slots, rank, model.dtype)
    model.lora_slots, model.lora_rank = slots, rank


def enable_expert_lora(experts: nn.Module, slots: int, rank: int, dtype: torch.dtype) -> None:
    """Gives a layer's experts (model/moe.py Experts) a pool for each of gate_up and down."""
    ex = experts
    if ex.shape.weight_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LoRAError(f"LoRA on quantized experts ({ex.shape.weight_dtype}) is not supported")
    e, h, i, lo, n, w = ex.num_experts, ex.hidden, ex.inter, ex.lo, ex.owned, ex.local
    device = ex.gate_up.device
    ex.lora_gate_up = LoRAExperts(e, 2 * w, ex.hidden_in, [(lo, 0, n), (i + lo, w, n)], (0, 0, h), (2 * i, h),
                                  slots, rank, dtype, device)
    ex.lora_down = LoRAExperts(e, ex.hidden_in, w, [(0, 0, h)], (lo, 0, n), (h, i), slots, rank, dtype, device)


# ---- adapters on the host ----------------------------------------------------------------------------

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class Fingerprint:
    """Who an adapter is: each of its files' (size, mtime in ns, SHA-256 of the bytes read)."""

    files: tuple[tuple[int, int, str], ...]

    def stat_matches(self, path: str) -> bool:
        """Whether the files' sizes and mtimes are still those (a stat each, no read)."""
        try:
            now = [os.stat(os.path.join(path, name)) for name in ADAPTER_FILES]
        except OSError:
            return False
        return [(st.st_size, st.st_mtime_ns) for st in now] == [f[:2] for f in self.files]


def fingerprint(path: str) -> Fingerprint:
    """The fingerprint of the adapter files at `path` as they are now (LoRAError when unreadable)."""
    return _read_files(path)[1]


def _read_files(path: str) -> tuple[list[bytes], Fingerprint]:
    """The adapter's files, each read once: the fingerprint is of the very bytes parsed."""
    data, files = [], []
    for name in ADAPTER_FILES:
        try:
            with open(os.path.join(path, name), "rb") as f:
                st = os.fstat(f.fileno())
                data.append(f.read())
        except FileNotFoundError:
            raise LoRAError(f"no {name}" + (" (blockdiff reads adapters in safetensors only)"
                                            if name.endswith(".safetensors") else "")) from None
        except OSError as e:
            raise LoRAError(f"cannot read {name} ({e.strerror or type(e).__name__})") from None
        files.append((st.st_size, st.st_mtime_ns, hashlib.sha256(data[-1]).hexdigest()))
    return data, Fingerprint(tuple(files))


@dataclass
class Adapter:
    """An adapter read from disk: per (mode, layer key, part), its A, B and scale; the fingerprint
    of the files they were read from."""

    path: str
    rank: int
    deltas: dict[tuple[int, tuple[int, str, str], int], tuple[torch.Tensor, torch.Tensor, float, str]]
    fingerprint: Fingerprint

    @property
    def experts(self) -> bool:
        """Whether it targets the experts (a step with such an adapter runs the experts' pools)."""
        return any(key[1] == "experts" for _, key, _ in self.deltas)


def read_adapter(path: str, max_rank: int | None = None, expect: Fingerprint | None = None) -> Adapter:
    """PEFT's adapter at `path`, checked: a LoRAError says what blockdiff cannot read or apply (the
    caller names the adapter; no message quotes the config's values). `expect`: the fingerprint the
    files must still have (LoRAError if they changed)."""
    (config_bytes, weights), found = _read_files(path)
    if expect is not None and found != expect:
        raise LoRAError("its files changed on disk since it was loaded")
    try:
        cfg = json.loads(config_bytes)
    except ValueError:  # UnicodeDecodeError too
        raise LoRAError("adapter_config.json is not JSON") from None
    if not isinstance(cfg, dict):
        raise LoRAError("adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError("peft_type is not LORA, the only kind blockdiff serves")
    for key, ok in (("use_dora", False), ("bias", "none"), ("lora_bias", False), ("modules_to_save", None),
                    ("trainable_token_indices", None)):
        if cfg.get(key, ok) not in (ok, [], {}):
            raise LoRAError(f"{key} is not supported")
    if cfg.get("layer_replication"):
        raise LoRAError("layer_replication is not supported")
    alpha, rslora, default_rank = cfg.get("lora_alpha", 8), cfg.get("use_rslora", False), cfg.get("r", 8)
    alpha_pattern, rank_pattern = cfg.get("alpha_pattern") or {}, cfg.get("rank_pattern") or {}
    targets = cfg.get("target_parameters") or []
    if not (_number(alpha) and isinstance(rslora, bool) and _positive(default_rank) and isinstance(targets, list)
            and isinstance(alpha_pattern, dict) and isinstance(rank_pattern, dict)
            and all(_number(v) for v in alpha_pattern.values()) and all(_positive(v) for v in rank_pattern.values())):
        raise LoRAError("adapter_config.json: r, lora_alpha, use_rslora, alpha_pattern, rank_pattern or "
                        "target_parameters has a value of the wrong type")
    for target in targets:
        owner, _, param = target.rpartition(".") if isinstance(target, str) else ("", "", "")
        if param not in EXPERT_PARAMS or not (owner == "experts" or owner.endswith(".experts")):
            raise LoRAError(f"target_parameters: blockdiff applies LoRA to the experts' "
                            f"{' and '.join(EXPERT_PARAMS)} only")

    def pattern(patterns: dict, name: str, default):
        for key, value in patterns.items():
            try:
                if re.search(rf"(^|\.){key}$", name):
                    return value
            except re.error:
                raise LoRAError("alpha_pattern or rank_pattern has a key that is not a regular expression") from None
        return default

    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        loaded = load(weights)
    except SafetensorError as e:
        raise LoRAError(f"adapter_model.safetensors cannot be read: {e}") from None
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in loaded.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise LoRAError(f"tensor {key[:200]!r} is not a LoRA weight blockdiff can apply")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoRAError(f"tensor {key[:200]!r} is not a 2-D floating-point matrix")
        tensors.setdefault(m.group(1), {})[m.group(2)] = tensor
    deltas = {}
    top = 0
    for module, ab in sorted(tensors.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAError(f"{module} lacks {({'lora_A', 'lora_B'} - set(ab)).pop()}")
        owner = re.sub(r"(\.base_layer)+$", "", module)
        targeted = [p for p in EXPERT_PARAMS if any(f"{owner}.{p}".endswith(t) for t in targets)]
        mode, key, part = place(module, targeted)
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[0]
        if key[1] == "experts":  # A holds every expert's r rows: the rank is the config's
            module = f"{owner}.{key[2]}"
            r = pattern(rank_pattern, module, default_rank)
        if r < 1:
            raise LoRAError(f"{module} has rank 0 (lora_A has no rows)")
        if max_rank is not None and r > max_rank:
            raise LoRAError(f"{module} has rank {r}, more than --max-lora-rank {max_rank}")
        top = max(top, r)
        scale = pattern(alpha_pattern, module, alpha) / (r**0.5 if rslora else r)
        deltas[(mode, key, part)] = (a, b, scale, module)
    return Adapter(path, top, deltas, found)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_fits(adapter: Adapter, config) -> None:
    """LoRAError unless every delta of `adapter` fits the model of GemmaConfig `config` (a layer it
    has, the projection's shape): checked when a request names it, so that a step never meets it."""
    h, heads, inter = config.hidden_size, config.num_heads, config.intermediate_size
    for (_, (layer, block, name), part), (a, b, _, module) in adapter.deltas.items():
        if layer >= len(config.layers):
            raise LoRAError(f"the adapter targets {module}, but the model has {len(config.layers)} layers")
        if block == "experts":
            e, i = config.num_experts, config.moe_intermediate_size
            out, inp = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}[name]
            if a.shape[0] % e or a.shape[1] != inp or b.shape[0] != out or b.shape[1] != a.shape[0]:
                raise LoRAError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the model's "
                                f"{e} experts ([{e} x r, {inp}] / [{out}, r x {e}])")
            continue
        if layer < 0 or block == "mlp":
            shape = {"gate_up_proj": (inter, h), "down_proj": (h, inter)}[name]
        else:
            spec = config.layers[layer]
            if part == 2 and not spec.has_v_proj:
                raise LoRAError(f"the adapter targets {module}, which this checkpoint does not have (no v_proj in that layer)")
            if name == "o_proj":
                shape = (h, heads * spec.head_dim)
            else:  # q, k, v
                shape = ((heads if part == 0 else spec.num_kv_heads) * spec.head_dim, h)
        out, inp = shape
        if a.shape[1] != inp or b.shape[0] != out or b.shape[1] != a.shape[0]:
            raise LoRAError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the model "
                            f"([r, {inp}] / [{out}, r])")


def put_adapter(model: nn.Module, slot: int, adapter: Adapter | None) -> None:
    """Writes `adapter` into pool slot `slot` of every LoRA layer (None: clears it). Every delta is
    checked before the first write: an adapter that does not fit leaves the slot empty, never half
    written (a request running on it would get weights of no adapter)."""
    pools = lora_pools(model)
    try:
        for (_, key, part), (a, b, _, name) in (adapter.deltas.items() if adapter is not None else ()):
            if key not in pools:
                raise LoRAError(f"the adapter targets {name}, but the model has no such layer")
            pools[key].check(part, a, b, name)
    finally:
        for pool in pools.values():
            pool.clear(slot)
    if adapter is None:
        return
    for (mode, key, part), (a, b, scale, name) in adapter.deltas.items():
        pools[key].put(slot, mode, part, a, b, scale, name)


class AdapterCache:
    """Adapters read from disk, kept in host memory (the --max-cpu-loras most recently used), each
    under the fingerprint of the files it was read from: one read again (evicted, or asked for under
    another fingerprint) must come from files of the fingerprint asked for."""

    def __init__(self, capacity: int, max_rank: int | None = None):
        self.capacity, self.max_rank = max(1, capacity), max_rank
        self.entries: OrderedDict[str, Adapter] = OrderedDict()

    def get(self, path: str, expect: Fingerprint | None = None) -> Adapter:
        """The adapter at `path` whose files have the fingerprint `expect` (None: as they are now)."""
        cached = self.entries.get(path)
        if cached is not None and expect in (None, cached.fingerprint):
            self.entries.move_to_end(path)
            return cached
        self.entries.pop(path, None)
        adapter = read_adapter(path, self.max_rank, expect)
        self.entries[path] = adapter
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return adapter
