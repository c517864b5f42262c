"""DiffusionGemma's checkpoint tensors: their Hugging Face names mapped to the model's parameters
(model/loader.py loads by them, model/saver.py writes them), and `GemmaCheckpoint`, the
architecture's CheckpointFormat (its config.json is read by model/gemma_config.py)."""

from __future__ import annotations

import logging
import re
from typing import Any

from safetensors import safe_open
from torch import nn

from blockdiff.config import ModelConfig
from blockdiff.model.gemma_config import parse_config
from blockdiff.model.interface import CheckpointFormat
from blockdiff.model.vision import map_vision_name

log = logging.getLogger(__name__)

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."

# checkpoint name below DECODER / ENCODER -> (our parameter, part of a fused parameter)
_LAYER_RULES = [
    (r"self_attn\.q_proj\.weight", "attn.qkv_proj.weight", 0),
    (r"self_attn\.k_proj\.weight", "attn.qkv_proj.weight", 1),
    (r"self_attn\.v_proj\.weight", "attn.qkv_proj.weight", 2),
    (r"self_attn\.o_proj\.weight", "attn.o_proj.weight", None),
    (r"self_attn\.(q_norm|k_norm)\.weight", r"attn.\1.weight", None),
    (r"self_attn\.(k_scale|v_scale)", r"attn.\1", None),  # compressed-tensors' FP8 KV cache scales
    (r"mlp\.gate_proj\.weight", "mlp.gate_up_proj.weight", 0),
    (r"mlp\.up_proj\.weight", "mlp.gate_up_proj.weight", 1),
    (r"mlp\.down_proj\.weight", "mlp.down_proj.weight", None),
    (r"router\.(proj\.weight|scale|per_expert_scale)", r"router.\1", None),
    (r"experts\.gate_up_proj", "experts.gate_up", None),
    (r"experts\.down_proj", "experts.down", None),
    (r"(\w+layernorm(?:_\d)?)\.weight", r"\1.weight", None),
]
_SC_RULES = [
    (r"pre_norm\.weight", "self_conditioning.pre_norm.weight", None),
    (r"gate_proj\.weight", "self_conditioning.mlp.gate_up_proj.weight", 0),
    (r"up_proj\.weight", "self_conditioning.mlp.gate_up_proj.weight", 1),
    (r"down_proj\.weight", "self_conditioning.mlp.down_proj.weight", None),
]


# compressed-tensors checkpoints store expert e as Linears; our gate_up part 2e+i holds its gate (i=0)
# or up (i=1), down part e its down.
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def map_name(name: str) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (parameter name, part), or None when it is not a weight we know."""
    vision = map_vision_name(name)
    if vision is not None:
        return vision
    # A quantized weight's companions "X.weight_scale", "X.input_scale", ... (whatever its format
    # stores) go with X.weight: to the parameters its quantization method names alike.
    base, _, suffix = name.rpartition(".")
    if suffix != "weight":
        mapped = map_name(f"{base}.weight")
        if mapped is not None:
            target, part = mapped
            if target.endswith(".weight"):  # "qkv_proj.weight" -> "qkv_proj.weight_scale"
                return target[: -len("weight")] + suffix, part
            # the experts' 3-D weights: "experts.down" -> "experts.down_scale" / "experts.down_input_scale"
            return f"{target}_{suffix.removeprefix('weight_')}", part
    m = _PER_EXPERT.fullmatch(name)
    if m:
        fused = map_name(f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}")
        if fused is None:
            return None
        e = int(m.group(2))
        return fused[0], {"gate_proj": 2 * e, "up_proj": 2 * e + 1, "down_proj": e}[m.group(3)]
    if name.startswith(DECODER + "self_conditioning."):
        rest = name[len(DECODER + "self_conditioning.") :]
        return _apply(_SC_RULES, rest, "")
    for prefix in (DECODER, ENCODER):
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix) :]
        if rest == "embed_tokens.weight":
            return "embed.weight", None
        if rest == "norm.weight":
            return "norm.weight", None
        m = re.fullmatch(r"layers\.(\d+)\.layer_scalar", rest)
        if m:
            return f"layers.{m.group(1)}.{'decoder' if prefix == DECODER else 'encoder'}_scalar", None
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m:
            return _apply(_LAYER_RULES, m.group(2), f"layers.{m.group(1)}.")
    return None


def _apply(rules, rest: str, prefix: str):
    for pattern, target, part in rules:
        m = re.fullmatch(pattern, rest)
        if m:
            return prefix + m.expand(target), part
    return None


def _has_vision_tensors(files: list[str]) -> bool:
    for file in files:
        with safe_open(file, framework="pt") as f:
            if any(map_vision_name(name) is not None for name in f.keys()):
                return True
    return False


class GemmaCheckpoint(CheckpointFormat):
    """DiffusionGemma's Hugging Face checkpoints. Shared layer weights may be spelled under the
    decoder or the encoder; the decoder's win, as in the reference's tying (the layer scalars, the
    one weight the modes do not share, come under both). The tied LM head is not loaded, and a
    vision tower only where config.json declares one."""

    def parse_config(self, raw: dict[str, Any]) -> ModelConfig:
        return parse_config(raw)

    def map_name(self, name: str) -> tuple[str, int | None] | None:
        return map_name(name)

    def secondary(self, name: str, target: str) -> bool:
        return name.startswith(ENCODER) and not target.endswith("_scalar")

    def ignored(self, model: nn.Module, name: str) -> bool:
        # lm_head: tied to the embedding (some exports still write it)
        return name == "lm_head.weight" or (model.vision is None and map_vision_name(name) is not None)

    def prepare(self, model: nn.Module, files: list[str]) -> None:
        if model.vision is not None and not _has_vision_tensors(files):
            # A vision_config without the tower's weights: a text-only export of a multimodal model.
            log.info("%r declares a vision tower but holds none of its tensors: image input is off", files[0])
            model.vision = None
        elif model.vision is None and _has_vision_tensors(files):
            log.info("%r holds vision tensors that its config.json declares no tower for: skipped", files[0])
