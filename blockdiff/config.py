"""Model configuration read from a checkpoint's config.json, without transformers.

Only what changes the computation is kept, resolved per layer, so that the model code never has to
re-derive a head dim or a window from the raw dictionary.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from blockdiff.quantization import Fp8Config, parse_quantization

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

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


class ConfigError(ValueError):
    """A checkpoint configuration blockdiff cannot run."""


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
class ModelConfig:
    vocab_size: int
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
    canvas_length: int
    encoder_causal: bool
    max_position_embeddings: int
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    quantization: Fp8Config | None = None  # FP8 weights (quantization_config), None: plain weights
    vision: "VisionConfig | None" = None  # the image encoder; None: a text-only checkpoint
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def sliding_window(self) -> int | None:
        return next((layer.window for layer in self.layers if layer.sliding), None)

    def first_layers(self, n: int) -> "ModelConfig":
        """This config with its first n layers only (--num-layers-override)."""
        if n > self.num_layers:
            raise ConfigError(f"num_layers_override {n} exceeds the model's {self.num_layers} layers")
        return replace(self, layers=self.layers[:n])

    def window_past(self, max_model_len: int) -> int:
        """Cached positions a sliding layer reads: the window's past, or the whole sequence if shorter."""
        window = self.sliding_window
        return max(1, min(window - 1, max_model_len)) if window else 1

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
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
        if dtype_name not in _DTYPES:
            raise ConfigError(f"unsupported dtype {dtype_name!r}")
        return cls(
            vocab_size=int(text["vocab_size"]),
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
            canvas_length=int(raw.get("canvas_length") or 256),
            encoder_causal=bidirectional != "all",
            max_position_embeddings=int(text.get("max_position_embeddings", 131_072)),
            pad_token_id=text.get("pad_token_id", 0),
            bos_token_id=text.get("bos_token_id", 2),
            eos_token_ids=eos_ids,
            dtype=_DTYPES[dtype_name],
            quantization=parse_quantization(raw.get("quantization_config")),
            vision=VisionConfig.from_dict(raw, bidirectional == "vision"),
            raw=raw,
        )


def read_config_json(path: str) -> dict:
    """path/config.json, or `path` itself when it is a JSON file (a config alone, for dummy weights)."""
    config_path = path if os.path.isfile(path) and path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"no config.json in {path!r}")
    return read_json(config_path)


def read_json(path: str) -> dict:
    """A checkpoint's JSON file; a ConfigError names the file and where it is broken."""
    with open(path) as f:
        try:
            value = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def parse_dtype(name: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """Resolve a user's dtype choice; "auto" takes the checkpoint's."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return config.dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
    return _DTYPES[name]


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


# Whether static steps are compiled unless the user says, per device type: the faster of compiled
# and eager as measured (docs/benchmarks.md, "Compiled steps"). On CUDA the static steps are CUDA
# graphs either way; compiling adds one inductor compile per shape the server meets, and what it
# buys there has not been measured yet (scripts/device_check.sh's "compiled" part measures it).
COMPILE_BY_DEFAULT = {"cpu": False, "cuda": False}

LOAD_FORMATS = ("auto", "dummy")


@dataclass
class EngineConfig:
    """How the engine runs a model: read once at the edge (CLI, `LLM(...)`) and passed down. Each
    engine default is written here and nowhere else."""

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 16
    max_model_len: int | None = None  # None: min(8192, the model's max_position_embeddings)
    kv_cache_memory: int | None = None  # bytes for full-attention blocks; None: enough for max_num_seqs at max_model_len
    block_size: int = 16
    max_prefill_tokens: int = 2048
    seed: int = 0
    tokenizer: str | None = None  # tokenizer directory; None: the model's
    chat_template: str | None = None  # overrides the tokenizer's
    max_denoising_steps_limit: int | None = None  # None: 4 x the canvas length (at least the checkpoint's default)
    # A running request that has committed this many canvases since it was admitted gives its slot
    # to a waiting request at its next canvas boundary (and is recomputed later); None: never.
    preempt_after_canvases: int | None = 4
    # Full blocks of committed tokens stay cached and are reused by requests that share the prefix
    # (engine/kv_cache_manager.py).
    enable_prefix_caching: bool = True
    tune_cpu_heap: bool = False  # see worker/cpu_heap.py: a process-wide glibc setting
    # Steps whose rows are all canvases being denoised run as one static step compiled with
    # torch.compile(fullgraph=True) (worker/canvas_step.py); None: COMPILE_BY_DEFAULT of the device.
    compile: bool | None = None
    # On CUDA the static steps are replayed as CUDA graphs, one per shape, unless this is set (and
    # then they are compiled only when compile=True), as vLLM's --enforce-eager.
    enforce_eager: bool = False
    num_threads: int | None = None  # tensor-parallel workers' intra-op threads; None: from their environment
    worker_timeout: float = 60.0  # seconds a tensor-parallel worker may stay silent before it counts as lost
    # GB the sampler's temporaries may take beside the logits (tiles of positions, identical results);
    # None: an eighth of the device's free memory when the worker starts, at most 1 GiB.
    sampler_memory_gb: float | None = None
    load_format: str = "auto"  # "auto": the checkpoint's safetensors; "dummy": random weights from config.json
    num_layers_override: int | None = None  # keep the first N layers (memory-limited runs at real widths)
    # Sampler defaults over the checkpoint's generation_config.json (the server's sampler flags),
    # as SamplingParams fields.
    sampling_defaults: dict = field(default_factory=dict)
    # Images one prompt may hold (vLLM's --limit-mm-per-prompt '{"image": N}'); 0 takes none.
    limit_images_per_prompt: int = 4
    max_image_bytes: int = 20 * 1024 * 1024  # an encoded image, before decoding
    max_image_pixels: int = 40_000_000  # width x height of a decoded image (~120 MB of RGB)
    # Image URLs besides data: URLs (vLLM's names): http(s) hosts that may be fetched, and the
    # directory whose files file:// URLs may name. Both off by default.
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_prefill_tokens", "tensor_parallel_size", "max_model_len",
                     "max_denoising_steps_limit", "preempt_after_canvases", "max_image_bytes", "max_image_pixels",
                     "num_layers_override"):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "max_denoising_steps_limit", "preempt_after_canvases",
                                          "num_layers_override"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        n = self.limit_images_per_prompt
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_images_per_prompt must be a non-negative integer, got {n!r}")
        if not (self.compile is None or isinstance(self.compile, bool)):
            raise ValueError(f"compile must be True, False or None (the device's default), got {self.compile!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        gb = self.sampler_memory_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 < gb < float("inf")):
            raise ValueError(f"sampler_memory_gb must be a positive number, got {gb!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.num_layers_override is not None and self.load_format != "dummy":
            raise ValueError("num_layers_override needs load_format='dummy' (a checkpoint holds every layer's weights)")

    def step_modes(self, device: str) -> tuple[bool | None, bool]:
        """(compile, cuda_graphs) on `device`; compile None: the device's default, where the model
        can run static steps."""
        cuda_graphs = torch.device(device).type == "cuda" and not self.enforce_eager
        return (bool(self.compile) if self.enforce_eager else self.compile), cuda_graphs

    def check_model(self) -> None:
        """The model is a checkpoint directory, or with dummy weights a config.json file alone."""
        if not (os.path.isdir(self.model) or (self.load_format == "dummy" and os.path.isfile(self.model))):
            raise ValueError(f"model {self.model!r} is not a checkpoint directory (nor, with load_format='dummy', "
                             "a config.json file)")

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass(frozen=True)
class VisionConfig:
    """The Gemma 4 vision encoder (`vision_config`) and how its soft tokens enter the prompt."""

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

    @classmethod
    def from_dict(cls, raw: dict[str, Any], bidirectional: bool) -> "VisionConfig | None":
        v = raw.get("vision_config")
        if not isinstance(v, dict):
            return None
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config: unsupported rope_type {rope.get('rope_type')!r} (Gemma 4 uses axial)")
        heads = int(v.get("num_attention_heads", 12))
        hidden = int(v.get("hidden_size", 768))
        return cls(
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
        )
