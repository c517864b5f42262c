"""DiffusionGemma's config.json, read without transformers: the engine's `ModelConfig`, and the
model's own `GemmaConfig` (per-layer shapes, RoPE, windows, experts) as its `arch`.

Only what changes the computation is kept, resolved per layer, so that the model code never has to
re-derive a head dim or a window from the raw dictionary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from blockdiff.config import ConfigError, ModelConfig, dtype_of
from blockdiff.parallel.quantization.base import QuantConfig
from blockdiff.parallel.quantization.registry import parse_quantization

ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"

# Fields the model cannot be built without; everything else has the reference defaults.
_REQUIRED_TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
)

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}

_LAYER_TYPES = ("sliding_attention", "full_attention")
_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}


@dataclass(frozen=True)
class LayerSpec:
    """Attention shape and position encoding of one layer."""

    sliding: bool
    head_dim: int
    num_kv_heads: int
    has_v_proj: bool  # full-attention layers use the raw k_proj output as V
    rope_theta: float
    rotary_dim: int  # dims that rotate; the rest of the head is position-free ("proportional" RoPE)
    rope_factor: float
    window: int | None  # sliding layers: positions visible to a query, itself included


@dataclass(frozen=True)
class GemmaConfig:
    """The Gemma 4 backbone of DiffusionGemma (config.json's text_config), as the model code reads it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    hidden_activation: str
    quantization: QuantConfig | None = None  # quantization_config (parallel/quantization/), None: plain weights

    def first_layers(self, n: int) -> "GemmaConfig":
        return replace(self, layers=self.layers[:n])


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig, with this architecture's GemmaConfig as its `arch`."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json has no text_config")
    missing = [k for k in _REQUIRED_TEXT_FIELDS if text.get(k) is None]
    if missing:
        raise ConfigError(f"config.json text_config is missing required fields: {', '.join(missing)}")
    if raw.get("tie_word_embeddings", True) is False or text.get("tie_word_embeddings", True) is False:
        raise ConfigError(
            "tie_word_embeddings=false (separate encoder, decoder and LM-head weights) is not supported; "
            "DiffusionGemma checkpoints tie them"
        )
    if text.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported by DiffusionGemma")

    num_layers = int(text["num_hidden_layers"])
    layer_types = list(text.get("layer_types") or _default_layer_types(num_layers))
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise ConfigError(f"unsupported layer types {unknown}")
    layer_types[-1] = "full_attention"  # the reference forces the last layer to full attention

    bidirectional = text.get("use_bidirectional_attention")
    window = int(text.get("sliding_window", 512))
    if bidirectional == "all":
        window = window // 2 + 1

    per_layer = _per_layer_overrides(text, layer_types)
    rope = _rope_parameters(text.get("rope_parameters"))
    layers = []
    for i, kind in enumerate(layer_types):
        over = per_layer.get(i, {})
        head_dim = int(over.get("head_dim", text["head_dim"]))
        kv_heads = int(over.get("num_key_value_heads", text["num_key_value_heads"]))
        if text["num_attention_heads"] % kv_heads:
            raise ConfigError(f"layer {i}: {text['num_attention_heads']} heads not divisible by {kv_heads} KV heads")
        layers.append(_layer_spec(i, kind, head_dim, kv_heads, rope[kind], window))

    # The top-level list (Gemma 4: [<eos>, <end_of_turn>]) over the text model's single id;
    # generation_config.json's, when there is one, wins over both (sampling_params.generation_defaults).
    eos = raw.get("eos_token_id") if raw.get("eos_token_id") is not None else text.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or "float32"
    gemma = GemmaConfig(
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_heads=int(text["num_attention_heads"]),
        layers=tuple(layers),
        num_experts=int(text["num_experts"]),
        top_k_experts=int(text["top_k_experts"]),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=text.get("final_logit_softcapping", 30.0),
        hidden_activation=text.get("hidden_activation", "gelu_pytorch_tanh"),
        quantization=parse_quantization(raw.get("quantization_config")),
    )
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=int(text["vocab_size"]),
        hidden_size=gemma.hidden_size,
        canvas_length=int(raw.get("canvas_length") or 256),
        windows=tuple(layer.window for layer in layers),
        encoder_causal=bidirectional != "all",
        max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
        pad_token_id=text.get("pad_token_id", 0),
        bos_token_id=text.get("bos_token_id", 2),
        eos_token_ids=eos_ids,
        dtype=dtype_of(dtype_name),
        arch=gemma,
        vision=_vision_config(raw, bidirectional == "vision"),
        raw=raw,
    )


@dataclass(frozen=True)
class VisionConfig:
    """An image encoder (Gemma 4's `vision_config`, which the architecture parses) and how its soft
    tokens enter the prompt: the engine expands image placeholders and preprocesses images by it."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_activation: str
    rms_norm_eps: float
    rope_theta: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    clipped_linears: bool  # each linear clamps its input and output to stored bounds
    standardize: bool  # soft tokens get (x - std_bias) * std_scale
    image_token_id: int  # the placeholder each soft token replaces
    boi_token_id: int | None
    eoi_token_id: int | None
    # use_bidirectional_attention == "vision": the tokens of one image attend to each other both
    # ways inside the otherwise causal encoder pass of the prompt.
    bidirectional: bool
    # A video frame's soft token (Gemma 4's config.json has it, DiffusionGemma's does not: then the
    # tokenizer's <|video|>, as transformers' processor takes it)
    video_token_id: int | None = None



def _vision_config(raw: dict[str, Any], bidirectional: bool) -> VisionConfig | None:
    v = raw.get("vision_config")
    if not isinstance(v, dict):
        return None
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"vision_config: unsupported rope_type {rope.get('rope_type')!r} (Gemma 4 uses axial)")
    heads = int(v.get("num_attention_heads", 12))
    hidden = int(v.get("hidden_size", 768))
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=int(v.get("intermediate_size", 3072)),
        num_layers=int(v.get("num_hidden_layers", 16)),
        num_heads=heads,
        num_kv_heads=int(v.get("num_key_value_heads", heads)),
        head_dim=int(v.get("head_dim") or hidden // heads),
        hidden_activation=v.get("hidden_activation", "gelu_pytorch_tanh"),
        rms_norm_eps=float(v.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        patch_size=int(v.get("patch_size", 16)),
        pooling_kernel_size=int(v.get("pooling_kernel_size", 3)),
        position_embedding_size=int(v.get("position_embedding_size", 10 * 1024)),
        clipped_linears=bool(v.get("use_clipped_linears", False)),
        standardize=bool(v.get("standardize", False)),
        image_token_id=int(raw.get("image_token_id", 258_880)),
        boi_token_id=raw.get("boi_token_id", 255_999),
        eoi_token_id=raw.get("eoi_token_id", 258_882),
        bidirectional=bidirectional,
        video_token_id=raw.get("video_token_id"),
    )


def _default_layer_types(num_layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]


def _per_layer_overrides(text: dict, layer_types: list[str]) -> dict[int, dict]:
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        # How the reference builds per_layer_config when a config predates it.
        over = {"head_dim": text.get("global_head_dim", 512)}
        if text.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = text["num_global_key_value_heads"]
        return {i: over for i, kind in enumerate(layer_types) if kind == "full_attention"}
    out = {}
    for key, over in per_layer.items():
        unsupported = set(over) - _PER_LAYER_KEYS
        if unsupported:
            raise ConfigError(f"per_layer_config[{key}] overrides unsupported fields {sorted(unsupported)}")
        idx = int(key)
        if not 0 <= idx < len(layer_types):
            raise ConfigError(f"per_layer_config names layer {key}, but the model has {len(layer_types)} layers")
        out[idx] = over
    return out


def _rope_parameters(rope: dict | None) -> dict[str, dict]:
    if rope is None:
        return _DEFAULT_ROPE
    if "rope_type" in rope or "rope_theta" in rope:  # one set of parameters for every layer type
        return {kind: rope for kind in _LAYER_TYPES}
    missing = [kind for kind in _LAYER_TYPES if kind not in rope]
    if missing:
        raise ConfigError(f"rope_parameters has no entry for {missing}")
    return rope


def _layer_spec(idx: int, kind: str, head_dim: int, kv_heads: int, rope: dict, window: int) -> LayerSpec:
    rope_type = rope.get("rope_type", "default")
    fraction = float(rope.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        if fraction != 1.0:
            raise ConfigError(f"layer {idx}: default RoPE with partial_rotary_factor {fraction} is not supported")
        rotary_dim = head_dim
        factor = 1.0
    elif rope_type == "proportional":
        rotary_dim = 2 * int(fraction * head_dim // 2)
        factor = float(rope.get("factor", 1.0))
    else:
        raise ConfigError(f"layer {idx}: unsupported rope_type {rope_type!r}")
    sliding = kind == "sliding_attention"
    return LayerSpec(
        sliding=sliding,
        head_dim=head_dim,
        num_kv_heads=kv_heads,
        has_v_proj=sliding,
        rope_theta=float(rope["rope_theta"]),
        rotary_dim=rotary_dim,
        rope_factor=factor,
        window=window if sliding else None,
    )
