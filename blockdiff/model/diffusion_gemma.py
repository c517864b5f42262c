"""DiffusionGemma: one Gemma 4 MoE backbone used in encoder and decoder mode.

One forward pass runs both modes at once: encoder-mode tokens (prompt chunks, finished canvases)
are packed before decoder-mode tokens (canvases being denoised). The two modes share every weight
except the per-layer scalar; decoder tokens also get the self-conditioning input, and only they
reach the LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from blockdiff.config import ModelConfig
from blockdiff.parallel.self_conditioning import soft_embedding
from blockdiff.ops.kernels import expert_kernel, static_kernel, target
from blockdiff.ops.softcap import softcap_
from blockdiff.model.attention import ROW_ALIGN, Attention, AttentionMetadata
from blockdiff.model.gemma_config import GemmaConfig, LayerSpec
from blockdiff.model.interface import LayerCacheSpec
from blockdiff.model.layers import RMSNorm, Rotary, unit_rms
from blockdiff.model.moe import GatedMLP, Router, make_experts
from blockdiff.model.vision import VisionEncoder
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.layers import VocabParallelEmbedding
from blockdiff.parallel.vocab import VocabShard
from blockdiff.parallel.quantization.base import QuantizationError
from blockdiff.step import ImageInputs

# The checkpoint's name of the modules that the quantization_config's patterns match.
PREFIX = "model.decoder"
# Rows of the LM head per product where its output is widened to the float32 logits (a model in
# bfloat16): that output exists for these rows only, not beside the whole logits. A multiple of
# ROW_ALIGN, so each row is computed as in one product of all of them.
HEAD_ROWS = 32 * ROW_ALIGN

NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
    "pre_feedforward_layernorm_2",
)


class Block(nn.Module):
    def __init__(self, config: GemmaConfig, spec: LayerSpec, group: TPGroup, dtype: torch.dtype, prefix: str):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.attn = Attention(config, spec, group, dtype, f"{prefix}.self_attn")
        act, quant = config.hidden_activation, config.quantization
        self.mlp = GatedMLP(h, config.intermediate_size, act, group, dtype, quant, f"{prefix}.mlp")
        self.router = Router(config, dtype, f"{prefix}.router")
        self.experts = make_experts(config, group, dtype, f"{prefix}.experts")
        for name in NORMS:
            setattr(self, name, RMSNorm(h, eps, dtype=dtype))
        # The one weight the modes do not share (a buffer in the reference, stored per mode).
        self.encoder_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)
        self.decoder_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        residual = x
        x = self.post_attention_layernorm(self.attn(self.input_layernorm(x), meta, cache))
        x = residual + x

        residual = x
        # The MLP's, the experts' and the router's norms all normalise x: its rms is taken once.
        unit = unit_rms(x, self.pre_feedforward_layernorm.eps)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm.scaled(unit, x.dtype)))
        weights, index = self.router.route(self.router.norm.scaled(unit, x.dtype))
        experts = self.experts(self.pre_feedforward_layernorm_2.scaled(unit, x.dtype), weights, index)
        moe = self.post_feedforward_layernorm_2(experts)
        x = residual + self.post_feedforward_layernorm(dense + moe)

        ne = meta.num_encoder_tokens
        if ne:
            x[:ne] *= self.encoder_scalar
        if ne < x.shape[0]:
            x[ne:] *= self.decoder_scalar
        return x


class SelfConditioning(nn.Module):
    """post_norm(canvas embeddings + MLP(pre_norm(soft embeddings of the previous step)))."""

    def __init__(self, config: GemmaConfig, group: TPGroup, dtype: torch.dtype):
        super().__init__()
        h = config.hidden_size
        self.pre_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(
            h, config.intermediate_size, config.hidden_activation, group, dtype, config.quantization, f"{PREFIX}.self_conditioning"
        )
        self.post_norm = RMSNorm(h, config.rms_norm_eps, with_scale=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor | None) -> torch.Tensor:
        # Without a previous step the reference feeds zeros, whose MLP output is exactly zero (an
        # adapter's delta of zeros too).
        if soft is not None:
            embeds = embeds + self.mlp(self.pre_norm(soft))
        return self.post_norm(embeds)


class DiffusionGemma(nn.Module):
    def __init__(self, config: ModelConfig, group: TPGroup | None = None, dtype: torch.dtype | None = None):
        """config: the engine's, whose `arch` is this model's GemmaConfig (model/gemma_checkpoint.py)."""
        super().__init__()
        group = group or TPGroup()
        dtype = dtype or config.dtype
        self.config = config
        gemma: GemmaConfig = config.arch
        self.group = group
        self.dtype = dtype
        self.shard = VocabShard.make(group.rank, group.size, config.vocab_size)
        # The reference rounds sqrt(hidden) to the weight dtype before scaling.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, device="cpu").to(dtype))
        self.embed = VocabParallelEmbedding(self.shard, config.hidden_size, group, self.embed_scale, dtype=dtype)
        if gemma.quantization is not None and gemma.quantization.linear_method("lm_head") is not None:
            raise QuantizationError("quantization_config quantizes lm_head; blockdiff runs the (tied) LM head unquantized")
        self.layers = nn.ModuleList(
            Block(gemma, spec, group, dtype, f"{PREFIX}.layers.{i}") for i, spec in enumerate(gemma.layers)
        )
        self.norm = RMSNorm(gemma.hidden_size, gemma.rms_norm_eps, dtype=dtype)
        self.self_conditioning = SelfConditioning(gemma, group, dtype)
        self.rotary = nn.ModuleDict()
        for spec in gemma.layers:
            key = "sliding" if spec.sliding else "full"
            if key not in self.rotary:
                self.rotary[key] = Rotary(spec)
        self.softcap = gemma.final_logit_softcapping
        # Replicated on every rank (blockdiff.model.vision); None for a text-only checkpoint.
        self.vision = VisionEncoder(config.vision, gemma.hidden_size, gemma.rms_norm_eps, dtype) if config.vision else None

    # ---- the engine's interface (blockdiff.model.interface.BlockDiffusionModel) ------------------
    def kv_cache_spec(self) -> list[LayerCacheSpec]:
        return [LayerCacheSpec(spec.sliding, layer.attn.local_kv_heads, layer.attn.head_dim)
                for layer, spec in zip(self.layers, self.config.arch.layers)]

    def static_shapes(self, device: torch.device) -> bool:
        """Whether a step can run with static shapes and no host sync on `device`: every MoE block
        runs grouped expert products there (blockdiff/ops/kernels.py)."""
        where = target(device)
        return all(static_kernel(expert_kernel(where, self.dtype, layer.experts.shape)[0]) for layer in self.layers)

    def soft_embed(self, probs: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """Self-conditioning input from this rank's unnormalised probabilities [rows, CL, local
        vocab] and their full-vocabulary sums [rows, CL]: one matmul per rank, one all-reduce."""
        # exp / Σexp are the probabilities: the normalisation rides on the scale, one multiply
        scale = (self.embed_scale / total).unsqueeze(-1)
        return soft_embedding(probs.to(self.dtype), self.embed.weight, scale, self.shard, self.group).to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        soft_embeds: torch.Tensor | None = None,
        images: ImageInputs | None = None,
        logits_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [meta.num_tokens] packed [encoder | decoder | padding]; soft_embeds
        [decoder tokens, hidden] or None; images: the soft tokens that replace image placeholders.

        Returns float32 soft-capped logits of the decoder tokens over this rank's vocabulary rows,
        written into `logits_out` ([decoder tokens, local vocab] float32) where given.
        """
        hidden = self.backbone(input_ids, meta, cache, soft_embeds, images)
        ne = meta.num_encoder_tokens
        return self.logits(self.norm(hidden[ne : ne + meta.num_decoder_tokens]), logits_out)

    def backbone(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        soft_embeds: torch.Tensor | None = None,
        images: ImageInputs | None = None,
    ) -> torch.Tensor:
        """Last-layer hidden states of every token, before the final norm."""
        x = self.embed(input_ids)
        if images is not None:
            x[images.token_index] = self.vision.soft_tokens(images).to(x.dtype)
        ne, nd = meta.num_encoder_tokens, meta.num_decoder_tokens
        if nd:
            x[ne : ne + nd] = self.self_conditioning(x[ne : ne + nd], soft_embeds)
        for key, rotary in self.rotary.items():
            kind = meta.kind(key == "sliding")
            kind.cos, kind.sin = rotary.cos_sin(meta.positions, x.dtype)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            if meta.active is not None:  # which layer's kept K/V its attention reads
                meta.active.layer = i
            x = layer(x, meta, layer_cache)
        return x

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if hidden.dtype == torch.float32 and out is None:  # the product's output is the logits
            logits = self.embed.logits(hidden)
        else:  # into `out`, or widened to float32: HEAD_ROWS rows at a time, never a second whole logits tensor
            logits = hidden.new_empty(hidden.shape[0], self.shard.local_rows, dtype=torch.float32) if out is None else out
            for a in range(0, hidden.shape[0], HEAD_ROWS):
                logits[a : a + HEAD_ROWS].copy_(self.embed.logits(hidden[a : a + HEAD_ROWS]))
        return softcap_(logits, self.softcap) if self.softcap else logits
