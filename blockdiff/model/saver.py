"""Save a `DiffusionGemma` as a Hugging Face checkpoint: the inverse of the loader.

Our fused parameters are split back into the checkpoint's tensors (qkv_proj -> q/k/v, gate_up_proj
-> gate/up) and the experts renamed (both store them [E, out, in]). Shared layer weights are
written once, under the decoder spelling (transformers ties the encoder's to them); the layer
scalars under both. Every name written is checked against the loader's own mapping, so saving and
loading cannot drift apart.
"""

from __future__ import annotations

import os
import re

import torch
from safetensors.torch import save_file

from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.gemma_checkpoint import DECODER, ENCODER, map_name
from blockdiff.model.vision import export_vision

# our parameter name below "layers.N." -> checkpoint names of its parts, below "model.decoder.layers.N."
_FUSED = {
    "attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_RENAMED = {
    "experts.gate_up": "experts.gate_up_proj",
    "experts.down": "experts.down_proj",
}
_SC_FUSED = {"mlp.gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight")}


def checkpoint_tensors(model: DiffusionGemma) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor, for every weight of a single-device model."""
    if model.group.size > 1:
        raise ValueError(f"saving needs the whole model on one device, not a shard of {model.group.size}")
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for ckpt_name, part, tensor in _export(model, name, param.detach()):
            if map_name(ckpt_name) != (name, part):
                raise AssertionError(f"saver writes {name} part {part} as {ckpt_name}, which the loader reads differently")
            out[ckpt_name] = tensor.contiguous().clone()
    return out


def _export(model: DiffusionGemma, name: str, param: torch.Tensor):
    """-> [(checkpoint name, part, tensor)] of one of our parameters."""
    if name in ("embed.weight", "norm.weight"):
        return [(DECODER + {"embed.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}[name], None, param)]
    if name.startswith("vision."):
        return export_vision(name, param)
    if name.startswith("self_conditioning."):
        rest = name[len("self_conditioning.") :]
        prefix = DECODER + "self_conditioning."
        if rest in _SC_FUSED:
            return _split(model, name, param, [prefix + n for n in _SC_FUSED[rest]])
        return [(prefix + rest.replace("mlp.", ""), None, param)]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None:
        raise ValueError(f"no checkpoint name for parameter {name!r}")
    layer, rest = m.groups()
    if rest in ("encoder_scalar", "decoder_scalar"):
        prefix = ENCODER if rest == "encoder_scalar" else DECODER
        return [(f"{prefix}layers.{layer}.layer_scalar", None, param)]
    prefix = f"{DECODER}layers.{layer}."
    if rest in _FUSED:
        return _split(model, name, param, [prefix + n for n in _FUSED[rest]])
    if rest in _RENAMED:  # without the padding the kernels need (model/moe.py)
        experts = model.get_submodule(f"layers.{layer}.experts")
        return [(prefix + _RENAMED[rest], None, experts.checkpoint_tensor(rest.removeprefix("experts.")))]
    return [(prefix + rest.replace("attn.", "self_attn.", 1), None, param)]


def _split(model: DiffusionGemma, name: str, param: torch.Tensor, names: list[str]):
    linear = model.get_submodule(name.rsplit(".", 1)[0])
    return [
        (ckpt_name, part, param[off : off + rows])
        for part, (ckpt_name, off, (_, rows, _)) in enumerate(zip(names, linear.offsets, linear.parts))
    ]


def save_weights(model: DiffusionGemma, out_dir: str, extra: dict[str, torch.Tensor] | None = None) -> str:
    """Write model.safetensors (text weights plus `extra`, e.g. a vision tower); -> its path."""
    tensors = checkpoint_tensors(model)
    tensors.update(extra or {})
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    write_safetensors(tensors, path)
    return path


def write_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """safetensors writes through a private temporary file (mode 0600); give the checkpoint the
    mode any new file gets (0666 less the umask), so others can read a shared checkpoint."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
