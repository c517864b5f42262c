"""The attention layer of both modes over a mixed batch, and the entry points that build a step's
attention metadata with the backend the cache geometry names (model/attention_backends).

A forward pass holds rows of two modes (model/attention_layout.py): encoder rows write their K/V
into the cache, then attend causally; decoder rows (canvases) attend bidirectionally to the cached
prefix and to their whole canvas and write nothing. The layer computes q, k and v and hands them to
the step's metadata, which holds the backend's kernel: the layer does not know which one runs.
"""

from __future__ import annotations

import torch
from torch import nn

from blockdiff.model.attention_backends import backend_module
from blockdiff.model.attention_layout import (FP8_KV_DTYPE, KEY_BLOCK, QUERY_TILE, ROW_ALIGN, ActiveRows,
                                              AttentionMetadata, CacheGeometry, Row, align, keep_kv, run_active_rows)
from blockdiff.model.gemma_config import GemmaConfig, LayerSpec
from blockdiff.model.layers import RMSNorm, apply_rotary, unit_rms
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.layers import ColumnParallelLinear, RowParallelLinear
from blockdiff.parallel.quantization.base import linear_method

__all__ = ["FP8_KV_DTYPE", "KEY_BLOCK", "QUERY_TILE", "ROW_ALIGN", "ActiveRows", "Attention", "AttentionMetadata", "CacheGeometry",
           "Row", "align", "build_metadata", "calculate_kv_scales", "canvas_metadata", "keep_kv", "qkv_parts",
           "run_active_rows"]

# --calculate-kv-scales: scale = max |x| of the first prefill / this, vLLM's K_SCALE_CONSTANT and
# V_SCALE_CONSTANT. The headroom (448 / 200 and 448 / 100) leaves room for later tokens' larger
# values, at the cost of some of E4M3's range below.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def build_metadata(rows: list[Row], geometry: CacheGeometry, kinds: set[bool], device: torch.device | str,
                   tables: dict[bool, torch.Tensor] | None = None) -> AttentionMetadata:
    """Metadata for one forward over `rows` (encoder rows first), by `geometry.backend`. `kinds`
    holds the layer kinds present (True: sliding). `tables`: the block tables per layer kind,
    [slots + 1, width] on the device, read at each row's slot; None: each row's own
    (`Row.blocks`, `Row.sliding_blocks`)."""
    return backend_module(geometry.backend).build_metadata(rows, geometry, kinds, device, tables)


def canvas_metadata(starts: torch.Tensor, tables: dict[bool, torch.Tensor], canvas_length: int, context: int,
                    geometry: CacheGeometry) -> AttentionMetadata:
    """Metadata for a step of canvases only, by `geometry.backend`, built on the device with no host
    sync: canvas r sits at positions starts[r]..+canvas_length and reads the cached positions before
    it through its block table tables[sliding][r] ([canvases, blocks], -1 for a given-back sliding
    block); `context`: the most cached positions any canvas reads."""
    return backend_module(geometry.backend).canvas_metadata(starts, tables, canvas_length, context, geometry)


def qkv_parts(config: GemmaConfig, spec: LayerSpec, group: TPGroup) -> list[tuple[int, int, int]]:
    """Row ranges of q, k (and v) owned by this rank. KV heads are split when there are at least as
    many as ranks, else each rank holds the one KV head its query heads use."""
    heads, kv, hd = config.num_heads, spec.num_kv_heads, spec.head_dim
    if heads % group.size:
        raise ValueError(f"{heads} attention heads cannot be split over {group.size} ranks")
    local_heads = heads // group.size
    if kv % group.size == 0:
        local_kv, kv_start = kv // group.size, group.rank * (kv // group.size)
    elif group.size % kv == 0:
        local_kv, kv_start = 1, (group.rank * local_heads) // (heads // kv)
    else:
        raise ValueError(f"{kv} KV heads cannot be split or replicated over {group.size} ranks")
    q = (heads * hd, local_heads * hd, group.rank * local_heads * hd)
    k = (kv * hd, local_kv * hd, kv_start * hd)
    return [q, k, k] if spec.has_v_proj else [q, k]


class Attention(nn.Module):
    def __init__(self, config: GemmaConfig, spec: LayerSpec, group: TPGroup, dtype: torch.dtype, prefix: str):
        """`prefix`: the checkpoint's name of this module, which the quantization_config's patterns match."""
        super().__init__()
        self.spec = spec
        parts = qkv_parts(config, spec, group)
        self.head_dim = spec.head_dim
        self.local_heads = parts[0][1] // spec.head_dim
        self.local_kv_heads = parts[1][1] // spec.head_dim
        qkv = [f"{prefix}.{n}_proj" for n in "qkv"[: len(parts)]]
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, dtype, linear_method(config.quantization, *qkv))
        self.o_proj = RowParallelLinear(config.num_heads * spec.head_dim, config.hidden_size, group, dtype,
                                        linear_method(config.quantization, f"{prefix}.o_proj"))
        self.q_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, dtype=dtype)
        self.v_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, with_scale=False)
        # An FP8 KV cache's per-layer scales (cache entry x scale = the value), float32 whatever the
        # model's dtype: a checkpoint's self_attn.k_scale / v_scale where it has them, else vLLM's 1.0,
        # or computed from the first prefill (`calculate_scales`, set by the runner). Not persistent:
        # optional in a checkpoint, not saved.
        self.group = group
        self.register_buffer("k_scale", _scale_buffer(), persistent=False)
        self.register_buffer("v_scale", _scale_buffer(), persistent=False)
        self.calculate_scales = False

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        kind = meta.kind(self.spec.sliding)
        n = x.shape[0]
        # q, k and v are normalised per head: one rms over all the heads of the projection (the
        # same bits per head), k's also giving v where the layer has no v_proj.
        unit = unit_rms(self.qkv_proj(x).view(n, -1, self.head_dim), self.q_norm.eps)
        h, kv = self.local_heads, self.local_kv_heads
        q = self.q_norm.scaled(unit[:, :h], x.dtype)
        k = self.k_norm.scaled(unit[:, h : h + kv], x.dtype)
        v = self.v_norm.scaled(unit[:, h + kv :] if self.spec.has_v_proj else unit[:, h : h + kv], x.dtype)
        q = apply_rotary(q, kind.cos, kind.sin)
        k = apply_rotary(k, kind.cos, kind.sin)

        scales = (self.k_scale, self.v_scale) if cache[0].dtype == FP8_KV_DTYPE else None
        # num_encoder_tokens first: a step of canvases only (compiled, graphed) never reads the flag.
        if meta.num_encoder_tokens and scales is not None and self.calculate_scales:
            self._calculate_scales(k[: meta.num_encoder_tokens], v[: meta.num_encoder_tokens])
        if meta.active is None:
            kind.write(k, v, cache, scales)  # first: an encoder row's queries read their own keys from the cache
            return self.o_proj(kind.attend(q, k, v, cache, scales))
        ne = meta.num_encoder_tokens
        q, k, v = meta.active.widen(q, k, v, ne)
        kind.write(k, v, cache, scales)
        return self.o_proj(meta.active.narrow(kind.attend(q, k, v, cache, scales), ne, n))

    def _calculate_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The scales from this prefill's K/V, then fixed. Each rank holds only its own KV heads: the
        max over the group, so that every rank (and a run on one) quantizes with the same scales."""
        amax = torch.stack((k.abs().amax(), v.abs().amax())).float()
        if self.group.size > 1:
            self.group.all_reduce(amax, "max")
        scales = (amax / amax.new_tensor([K_SCALE_RANGE, V_SCALE_RANGE])).clamp(min=torch.finfo(torch.float32).tiny)
        self.k_scale.copy_(scales[0])
        self.v_scale.copy_(scales[1])
        self.calculate_scales = False


def _scale_buffer() -> torch.Tensor:
    scale = torch.ones((), dtype=torch.float32)
    scale.weight_loader = _load_scale  # model/loader.py loads it where the checkpoint has one
    return scale


def _load_scale(scale: torch.Tensor, source, name: str) -> None:
    """A compressed-tensors k_scale / v_scale: one value, stored as [] or [1]."""
    value = torch.as_tensor(source[:] if len(source.get_shape()) else source[()]).float().reshape(-1)
    if value.numel() != 1:
        raise ValueError(f"tensor {name!r} has shape {list(source.get_shape())}: blockdiff takes one KV scale per layer")
    scale.copy_(value[0])


def calculate_kv_scales(model: nn.Module) -> None:
    """Every attention layer of `model` computes its FP8 cache scales at its next prefill."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.calculate_scales = True
