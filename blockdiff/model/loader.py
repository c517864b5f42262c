"""Load a Hugging Face DiffusionGemma checkpoint (safetensors only) into `DiffusionGemma`.

Each rank reads only its own slices: a tensor is opened lazily and each parameter's weight_loader
takes the rows or columns it owns.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re

import torch
from safetensors import safe_open
from tqdm import tqdm

from blockdiff.config import ModelConfig
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.parallel.group import TPGroup
from blockdiff.model.registry import load_config, model_class
from blockdiff.model.vision import map_vision_name
from blockdiff.parallel.layers import replicated_loader

log = logging.getLogger(__name__)

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# checkpoint name below DECODER / ENCODER -> (our parameter, part of a fused parameter)
_LAYER_RULES = [
    (r"self_attn\.q_proj\.weight", "attn.qkv_proj.weight", 0),
    (r"self_attn\.k_proj\.weight", "attn.qkv_proj.weight", 1),
    (r"self_attn\.v_proj\.weight", "attn.qkv_proj.weight", 2),
    (r"self_attn\.o_proj\.weight", "attn.o_proj.weight", None),
    (r"self_attn\.(q_norm|k_norm)\.weight", r"attn.\1.weight", None),
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


# FP8 companions of a weight "X.weight" (compressed-tensors): "X.weight_scale", "X.input_scale".
_FP8_SUFFIXES = ("weight_scale", "input_scale")
# compressed-tensors checkpoints store expert e as Linears; our gate_up part 2e+i holds its gate (i=0)
# or up (i=1), down part e its down.
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class CheckpointError(ValueError):
    pass


def map_name(name: str) -> tuple[str, int | None] | None:
    """Checkpoint tensor name -> (parameter name, part), or None when it is not a weight we know."""
    vision = map_vision_name(name)
    if vision is not None:
        return vision
    for suffix in _FP8_SUFFIXES:
        if name.endswith("." + suffix):
            mapped = map_name(name[: -len(suffix)] + "weight")
            if mapped is None:
                return None
            target, part = mapped
            if target.endswith(".weight"):  # "qkv_proj.weight" -> "qkv_proj.weight_scale"
                return target[: -len("weight")] + suffix, part
            # the experts' 3-D weights: "experts.down" -> "experts.down_scale" / "experts.down_input_scale"
            return f"{target}_{'scale' if suffix == 'weight_scale' else suffix}", part
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


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    pickles = [f for f in os.listdir(path) if f.endswith(PICKLE_SUFFIXES)] if os.path.isdir(path) else []
    if pickles:
        raise CheckpointError(
            f"{path!r} holds only pickle checkpoints ({', '.join(sorted(pickles))}); blockdiff loads only "
            "safetensors, since unpickling runs arbitrary code. Convert the checkpoint to safetensors first."
        )
    raise CheckpointError(f"no safetensors checkpoint in {path!r}")


def load_weights(model: DiffusionGemma, path: str) -> None:
    params = dict(model.named_parameters())
    seen_encoder, seen, unexpected, skipped = {}, set(), [], 0
    files = checkpoint_files(path)
    if model.vision is not None and not _has_vision_tensors(files):
        # A vision_config without the tower's weights: a text-only export of a multimodal model.
        log.info("%r declares a vision tower but holds none of its tensors: image input is off", path)
        model.vision = None
        params = dict(model.named_parameters())
    for file in tqdm(files, desc="Loading checkpoint shards", unit="shard", disable=len(files) < 2):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name == "lm_head.weight":  # tied to the embedding; some exports still write it
                    continue
                if model.vision is None and map_vision_name(name) is not None:
                    skipped += 1  # a vision tower that config.json does not declare
                    continue
                mapped = map_name(name)
                if mapped is None or mapped[0] not in params:
                    unexpected.append(name)
                    continue
                target, part = mapped
                if part is not None and part >= getattr(params[target], "num_parts", 1):
                    unexpected.append(name)  # e.g. v_proj on a layer whose keys are its values
                    continue
                key = (target, part)
                # Shared weights may be spelled under the decoder or the encoder; the decoder's win,
                # as in the reference's tying.
                if name.startswith(ENCODER) and not target.endswith("_scalar"):
                    seen_encoder[key] = (file, name)
                    continue
                _load_one(params[target], f.get_slice(name), name, part)
                seen.add(key)
    for key, (file, name) in seen_encoder.items():
        if key not in seen:
            with safe_open(file, framework="pt") as f:
                _load_one(params[key[0]], f.get_slice(name), name, key[1])
            seen.add(key)
    if skipped:
        log.info("skipped %d vision tensors: %r declares no vision tower", skipped, path)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in checkpoint {path!r}: {', '.join(sorted(unexpected))}")
    missing = sorted(_expected_keys(model) - seen)
    if missing:
        names = [f"{t}[part {p}]" if p is not None else t for t, p in missing]
        raise CheckpointError(f"tensors missing from checkpoint {path!r}: {', '.join(names)}")


def _has_vision_tensors(files: list[str]) -> bool:
    for file in files:
        with safe_open(file, framework="pt") as f:
            if any(map_vision_name(name) is not None for name in f.keys()):
                return True
    return False


def _load_one(param: torch.Tensor, source, name: str, part: int | None) -> None:
    # Parameters whose layer does not shard them (norms, scalars, the router) are copied whole.
    load = getattr(param, "weight_loader", replicated_loader)
    if part is None:
        load(param, source, name)
    else:
        load(param, source, name, part)


def _expected_keys(model: DiffusionGemma) -> set[tuple[str, int | None]]:
    keys = set()
    for name, param in model.named_parameters():
        parts = getattr(param, "num_parts", 1)
        keys.update([(name, i) for i in range(parts)] if parts > 1 else [(name, None)])
    return keys


def load_model(
    path: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    group: TPGroup | None = None,
    config: ModelConfig | None = None,
    load_format: str = "auto",
) -> DiffusionGemma:
    """The model of checkpoint `path`; load_format "dummy" reads only its config.json and fills the
    weights with small random values (timing and memory runs at real shapes without the file)."""
    config = config or load_config(path)
    cls = model_class(config)
    with torch.device(device):
        model = cls(config, group=group, dtype=dtype)
    if load_format == "dummy":
        dummy_weights(model)
    else:
        load_weights(model, path)
    return model.eval()


DUMMY_RANGE = 1e-3  # vLLM's dummy weights: uniform in [-1e-3, 1e-3]


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Every floating-point parameter uniform in ±DUMMY_RANGE, made on its own device in its own
    dtype, in place (FP8 weights, which uniform_ does not fill, through a float32 copy)."""
    for i, param in enumerate(model.parameters()):
        if param.is_floating_point():
            g = torch.Generator(param.device).manual_seed(seed + i)
            direct = param.dtype in (torch.float32, torch.bfloat16, torch.float16)
            target = param if direct else torch.empty(param.shape, device=param.device)
            target.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=g)
            if not direct:
                param.copy_(target)
    for module in model.modules():  # padding for the kernels (model/moe.py) stays zero
        if hasattr(module, "zero_padding"):
            module.zero_padding()
