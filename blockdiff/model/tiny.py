"""`blockdiff make-tiny-model`: a random DiffusionGemma checkpoint in exact Hugging Face layout.

Every parameter and buffer is random (norm weights, router and per-expert scales, and layer scalars
that differ between encoder and decoder), so a mix-up between two weights cannot hide behind a
default initialisation of ones. The checkpoint carries a small vision tower too, so transformers
loads it with no missing keys, and a real `tokenizers` tokenizer with a chat template. With
`vision=True` the tower is one made for image tests (GQA, clamped linears, standardised soft
tokens, image tokens bidirectional in the encoder), with image special tokens in the tokenizer and
a preprocessor_config.json.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch

from blockdiff.model.saver import write_safetensors

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# The multimodal variant: an image content part becomes one image token, which the processor expands
# into <start_of_image>, one token per soft token of the image, and <end_of_image>; a video part
# one video token, which becomes per sampled frame its timestamp and the frame as an image of video tokens.
CHAT_TEMPLATE_MM = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<image_soft_token>"
    "{% elif part['type'] in ('video', 'video_url') %}<|video|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "add_bos_token": True,
    "chat_template": CHAT_TEMPLATE,
    "model_max_length": 131072,
}

_CORPUS = """
Block diffusion language models write text one canvas at a time. Each canvas starts as random
tokens and is denoised over a few steps; the tokens the model is sure of are kept, the others are
drawn again. When the canvas is stable and confident it is committed to the cache, exactly as an
autoregressive model would cache it, and the next canvas begins. The quick brown fox jumps over
the lazy dog. Numbers such as 0 1 2 3 4 5 6 7 8 9 10 42 and 1234 appear in tasks like addition,
sorting and reversal. Hello, world! How are you today? I am fine, thank you.
"""


@dataclass
class TinySpec:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    global_head_dim: int = 32
    num_global_kv_heads: int = 1
    num_experts: int = 4
    top_k_experts: int = 2
    moe_intermediate_size: int = 32
    sliding_window: int = 16
    canvas_length: int = 16
    layer_types: list[str] | None = None  # default: alternate sliding / full, last full
    seed: int = 0
    dtype: str = "float32"
    spelling: str = "decoder"  # where the shared layer weights are written: "decoder" or "encoder"
    generation: dict = field(default_factory=dict)  # extra generation_config.json entries
    tokenizer: bool = True
    max_position_embeddings: int = 131_072
    vision: bool = False  # the multimodal variant (VISION_MM, image tokens, preprocessor_config.json)

    def resolved_layer_types(self) -> list[str]:
        if self.layer_types:
            return list(self.layer_types)
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_layers)]
        types[-1] = "full_attention"
        return types


VISION = dict(
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=4,
    patch_size=2,
    position_embedding_size=8,
    pooling_kernel_size=3,
    model_type="gemma4_vision",
)

# The tower of a multimodal tiny checkpoint: 2-D positions up to 256 patches per side, which covers
# the widest image the preprocessor makes (70 soft tokens of 3 x 3 patches of 2 x 2 pixels).
VISION_MM = dict(
    VISION,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    position_embedding_size=256,
    use_clipped_linears=True,
    standardize=True,
)
IMAGE_TOKENS = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
BOI, IMAGE, EOI = range(len(SPECIAL_TOKENS), len(SPECIAL_TOKENS) + len(IMAGE_TOKENS))
VIDEO_TOKENS = ["<|video|>"]  # transformers' Gemma4Processor adds it to a tokenizer that lacks it
VIDEO = EOI + 1
PREPROCESSOR = {
    "image_processor_type": "Gemma4ImageProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": False,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
    "patch_size": VISION_MM["patch_size"],
    "pooling_kernel_size": VISION_MM["pooling_kernel_size"],
    "max_soft_tokens": 70,
}

# Frames as transformers' Gemma4VideoProcessor makes them (its defaults but the tower's sizes), few of
# them so that a video's prompt stays short.
VIDEO_PREPROCESSOR = {
    "video_processor_type": "Gemma4VideoProcessor",
    "patch_size": VISION_MM["patch_size"],
    "pooling_kernel_size": VISION_MM["pooling_kernel_size"],
    "max_soft_tokens": 70,
    "num_frames": 3,
    "do_normalize": True,
    "image_mean": [0.0, 0.0, 0.0],
    "image_std": [1.0, 1.0, 1.0],
}


def config_dict(spec: TinySpec) -> dict:
    layer_types = spec.resolved_layer_types()
    per_layer = {
        str(i): {"head_dim": spec.global_head_dim, "num_key_value_heads": spec.num_global_kv_heads}
        for i, t in enumerate(layer_types)
        if t == "full_attention"
    }
    text = {
        "model_type": "diffusion_gemma_text",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "pad_token_id": PAD,
        "eos_token_id": [EOS, END_OF_TURN],
        "bos_token_id": BOS,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": spec.sliding_window,
        "layer_types": layer_types,
        "final_logit_softcapping": 30.0,
        "use_bidirectional_attention": "vision" if spec.vision else None,
        "num_experts": spec.num_experts,
        "top_k_experts": spec.top_k_experts,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "per_layer_config": per_layer,
        "initializer_range": 0.02,
    }
    out = {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": spec.canvas_length,
        "dtype": spec.dtype,
        "tie_word_embeddings": True,
        "text_config": text,
        "vision_config": dict(VISION_MM if spec.vision else VISION),
        "transformers_version": "5.23.0",
    }
    if spec.vision:
        out.update(image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)
    return out


def generation_config_dict(spec: TinySpec) -> dict:
    return {"bos_token_id": BOS, "eos_token_id": [EOS, END_OF_TURN], "pad_token_id": PAD, **spec.generation}


def random_tensors(spec: TinySpec) -> dict[str, torch.Tensor]:
    normal, around_one = _random_fns(torch.Generator().manual_seed(spec.seed))
    h, i, e, mi = spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.moe_intermediate_size
    text_prefix = "model.decoder." if spec.spelling == "decoder" else "model.encoder.language_model."
    t: dict[str, torch.Tensor] = {text_prefix + "embed_tokens.weight": normal(spec.vocab_size, h), text_prefix + "norm.weight": around_one(h)}
    for layer, kind in enumerate(spec.resolved_layer_types()):
        full = kind == "full_attention"
        hd = spec.global_head_dim if full else spec.head_dim
        kv = spec.num_global_kv_heads if full else spec.num_kv_heads
        p = f"{text_prefix}layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = normal(spec.num_heads * hd, h)
        t[p + "self_attn.k_proj.weight"] = normal(kv * hd, h)
        if not full:
            t[p + "self_attn.v_proj.weight"] = normal(kv * hd, h)
        t[p + "self_attn.o_proj.weight"] = normal(h, spec.num_heads * hd)
        t[p + "self_attn.q_norm.weight"] = around_one(hd)
        t[p + "self_attn.k_norm.weight"] = around_one(hd)
        t[p + "mlp.gate_proj.weight"] = normal(i, h)
        t[p + "mlp.up_proj.weight"] = normal(i, h)
        t[p + "mlp.down_proj.weight"] = normal(h, i)
        t[p + "router.proj.weight"] = normal(e, h, std=1.0)
        t[p + "router.scale"] = around_one(h)
        t[p + "router.per_expert_scale"] = around_one(e, spread=0.5)
        t[p + "experts.gate_up_proj"] = normal(e, 2 * mi, h)
        t[p + "experts.down_proj"] = normal(e, h, mi)
        for norm in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
            "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            t[p + norm + ".weight"] = around_one(h)
        t[f"model.decoder.layers.{layer}.layer_scalar"] = around_one(1, spread=0.5)
        t[f"model.encoder.language_model.layers.{layer}.layer_scalar"] = around_one(1, spread=0.5)
    sc = "model.decoder.self_conditioning."
    t[sc + "pre_norm.weight"] = around_one(h)
    t[sc + "gate_proj.weight"] = normal(i, h)
    t[sc + "up_proj.weight"] = normal(i, h)
    t[sc + "down_proj.weight"] = normal(h, i)
    t.update(_vision_tensors(h, normal, around_one, VISION_MM if spec.vision else VISION))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.dtype]
    return {k: v.to(dtype).contiguous() for k, v in t.items()}


def _random_fns(g: torch.Generator):
    def normal(*shape, std=None):
        std = std if std is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * std

    def around_one(*shape, spread=0.25):
        return 1.0 + spread * (2 * torch.rand(*shape, generator=g) - 1)

    return normal, around_one


def _vision_tensors(text_hidden: int, normal, around_one, v: dict = VISION) -> dict[str, torch.Tensor]:
    vh, vi, hd = v["hidden_size"], v["intermediate_size"], v["head_dim"]
    heads, kv = v["num_attention_heads"], v["num_key_value_heads"]
    t = {"model.encoder.embed_vision.embedding_projection.weight": normal(text_hidden, vh)}
    tower = "model.encoder.vision_tower."
    t[tower + "patch_embedder.input_proj.weight"] = normal(vh, 3 * v["patch_size"] ** 2)
    t[tower + "patch_embedder.position_embedding_table"] = normal(2, v["position_embedding_size"], vh)
    for layer in range(v["num_hidden_layers"]):
        p = f"{tower}encoder.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            t[p + norm + ".weight"] = around_one(vh)
        t[p + "mlp.gate_proj.linear.weight"] = normal(vi, vh)
        t[p + "mlp.up_proj.linear.weight"] = normal(vi, vh)
        t[p + "mlp.down_proj.linear.weight"] = normal(vh, vi)
        t[p + "self_attn.q_proj.linear.weight"] = normal(heads * hd, vh)
        t[p + "self_attn.k_proj.linear.weight"] = normal(kv * hd, vh)
        t[p + "self_attn.v_proj.linear.weight"] = normal(kv * hd, vh)
        t[p + "self_attn.o_proj.linear.weight"] = normal(vh, heads * hd)
        t[p + "self_attn.q_norm.weight"] = around_one(hd)
        t[p + "self_attn.k_norm.weight"] = around_one(hd)
        if v.get("use_clipped_linears"):
            # Bounds that clamp a few inputs and outputs of every linear (unit-scale activations).
            for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                t[p + proj + ".input_min"] = -around_one((), spread=0.2) * 1.5
                t[p + proj + ".input_max"] = around_one((), spread=0.2) * 1.5
                t[p + proj + ".output_min"] = -around_one((), spread=0.2) * 1.5
                t[p + proj + ".output_max"] = around_one((), spread=0.2) * 1.5
    if v.get("standardize"):
        t[tower + "std_bias"] = normal(vh, std=0.5)
        t[tower + "std_scale"] = around_one(vh, spread=0.5)
    return t


def build_tokenizer(vocab_size: int, corpus: str = _CORPUS, specials: list[str] = SPECIAL_TOKENS):
    """A SentencePiece-style BPE (spaces become "▁") trained on `corpus`, with the special tokens
    first. Its vocabulary never exceeds `vocab_size`; characters outside it map to <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    chars = sorted(set(corpus.replace(" ", "▁").replace("\n", "▁")))
    budget = vocab_size - len(specials)
    if budget < 2:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for a tokenizer")
    alphabet = ["▁"] + [c for c in chars if c != "▁"][: budget - 1]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet,
        limit_alphabet=len(alphabet), show_progress=False,
    )
    tok.train_from_iterator([corpus] * 4, trainer=trainer)
    return tok


def write_tokenizer(out_dir: str, vocab_size: int, corpus: str = _CORPUS, vision: bool = False) -> None:
    if vision:
        tok = build_tokenizer(vocab_size, corpus, SPECIAL_TOKENS + IMAGE_TOKENS + VIDEO_TOKENS)
        save_tokenizer(out_dir, tok, {**TOKENIZER_CONFIG, "chat_template": CHAT_TEMPLATE_MM})
    else:
        save_tokenizer(out_dir, build_tokenizer(vocab_size, corpus))


def save_tokenizer(out_dir: str, tok, config: dict = TOKENIZER_CONFIG) -> None:
    """tokenizer.json, and tokenizer_config.json with the special tokens and the chat template."""
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def make_tiny_model(out_dir: str, spec: TinySpec | None = None, **overrides) -> str:
    spec = spec or TinySpec(**overrides)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict(spec), f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation_config_dict(spec), f, indent=2)
    write_safetensors(random_tensors(spec), os.path.join(out_dir, "model.safetensors"))
    if spec.tokenizer:
        write_tokenizer(out_dir, spec.vocab_size, vision=spec.vision)
    if spec.vision:
        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(PREPROCESSOR, f, indent=2)
        with open(os.path.join(out_dir, "video_preprocessor_config.json"), "w") as f:
            json.dump(VIDEO_PREPROCESSOR, f, indent=2)
    with open(os.path.join(out_dir, "blockdiff_tiny.json"), "w") as f:
        json.dump(asdict(spec), f, indent=2)
    return out_dir
