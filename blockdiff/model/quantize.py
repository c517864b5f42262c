"""Write a compressed-tensors FP8-dynamic checkpoint of a full-precision one, tensor by tensor.

The layout is the published DiffusionGemma FP8-dynamic one: every linear layer the scheme targets
holds an FP8 (E4M3) `weight` and a per-output-channel `weight_scale` [out, 1] in the source dtype;
the fused 3-D experts are split into per-expert `experts.{e}.gate_proj/up_proj/down_proj` Linears
(compressed-tensors quantizes Linears only, and vLLM reads experts this way); everything else —
embeddings, the (tied) LM head, routers, self-conditioning, norms, the vision tower — is copied
unchanged. Activations are quantized per token at run time, so nothing is calibrated.

Source tensors are read one at a time and output shards are flushed as they fill, so peak memory is
about one shard plus the largest tensor, whatever the model's size.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from blockdiff.ops.fp8 import quantize_rows
from blockdiff.model.gemma_checkpoint import DECODER, ENCODER
from blockdiff.model.loader import checkpoint_files
from blockdiff.parallel.quantization.fp8 import Fp8Config

# The ignore list of the published DiffusionGemma FP8-dynamic checkpoint.
DEFAULT_IGNORE = ("lm_head", "re:.*embed.*", "re:.*router.*", "re:.*vision.*", "re:.*self_conditioning.*")
FP8_DYNAMIC = Fp8Config(weight_strategy="channel", activations="dynamic", targets=("Linear",), ignore=DEFAULT_IGNORE)

_LINEAR = re.compile(r"(.*\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|router\.proj|self_conditioning\.(?:gate|up|down)_proj))\.weight")
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")
_SHARD_BYTES = 4 << 30
_WEIGHT_FILES = ("model.safetensors.index.json",)


def quantize_checkpoint(src: str, dst: str, scheme: Fp8Config = FP8_DYNAMIC) -> str:
    """Write the FP8 checkpoint of `src` into `dst` (created); -> dst."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src!r} is already quantized ({config['quantization_config'].get('quant_method')!r})")
    os.makedirs(dst, exist_ok=True)
    writer = _ShardWriter(dst)
    for file in checkpoint_files(src):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                for out_name, tensor in _convert(name, f.get_tensor(name), scheme):
                    writer.add(out_name, tensor)
    writer.close()
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and not entry.endswith(".safetensors") and entry not in _WEIGHT_FILES + ("config.json",):
            shutil.copy(path, os.path.join(dst, entry))
    config["quantization_config"] = scheme.to_dict()
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


def _convert(name: str, tensor: torch.Tensor, scheme: Fp8Config):
    """One source tensor -> [(name, tensor)] of the FP8 checkpoint."""
    text = name.startswith((DECODER, ENCODER))
    m = _LINEAR.fullmatch(name)
    if text and m and scheme.quantizes(m.group(1)):
        return _quantized(m.group(1), tensor, scheme)
    m = _FUSED_EXPERTS.fullmatch(name)
    if text and m:
        prefix, kind = m.groups()
        per_expert = []
        for e, w in enumerate(tensor):
            halves = zip(("gate_proj", "up_proj"), w.chunk(2)) if kind == "gate_up_proj" else [("down_proj", w)]
            per_expert += [(f"{prefix}.{e}.{proj}", half) for proj, half in halves]
        targeted = [scheme.quantizes(module) for module, _ in per_expert]
        if all(targeted):
            return [out for module, w in per_expert for out in _quantized(module, w, scheme)]
        if any(targeted):
            raise ValueError(f"the scheme quantizes only some of the experts in {name!r}")
    return [(name, tensor)]


def _quantized(module: str, weight: torch.Tensor, scheme: Fp8Config):
    if not weight.is_floating_point() or weight.element_size() < 2:
        raise ValueError(f"cannot quantize {module}.weight of dtype {weight.dtype}")
    q, scale = quantize_rows(weight, scheme.weight_strategy)
    return [(f"{module}.weight", q), (f"{module}.weight_scale", scale)]


class _ShardWriter:
    """Collects tensors into safetensors shards of about _SHARD_BYTES; one file needs no index."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= _SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            save_file(self.pending, self._path(len(self.shards)), metadata={"format": "pt"})
            self.shards.append(list(self.pending))
            self.pending, self.pending_bytes = {}, 0

    def _path(self, i: int) -> str:
        return os.path.join(self.out_dir, f"shard-{i:05d}.safetensors")

    def close(self) -> None:
        self._flush()
        n = len(self.shards)
        if n == 1:
            os.replace(self._path(0), os.path.join(self.out_dir, "model.safetensors"))
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._path(i), os.path.join(self.out_dir, final))
            weight_map.update(dict.fromkeys(names, final))
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
