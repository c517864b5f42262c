"""Write a compressed-tensors checkpoint of a full-precision one, one source file at a time.

The layout is the published DiffusionGemma FP8-dynamic one, whatever the scheme: every linear layer
the scheme targets holds its quantized tensors (FP8: an E4M3 `weight` and a per-output-channel
`weight_scale` [out, 1] in the source dtype; integer schemes: quantize_int.py); the fused 3-D
experts are split into per-expert `experts.{e}.gate_proj/up_proj/down_proj` Linears
(compressed-tensors quantizes Linears only, and vLLM reads experts this way); everything else —
embeddings, the (tied) LM head, routers, self-conditioning, norms, the vision tower — is copied
unchanged. FP8-dynamic quantizes activations per token at run time and the integer schemes not at
all, so nothing is calibrated.

Source files are read one at a time and output shards are flushed as they fill, so peak memory is
about one source file plus one shard, whatever the model's size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Protocol

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

# The Linears a scheme may quantize (the experts once split per expert); other ".weight"s are norms or embeddings.
_LINEAR = re.compile(r"(.*\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|router\.proj|experts\.\d+\.(?:gate|up|down)_proj"
                     r"|self_conditioning\.(?:gate|up|down)_proj))\.weight")
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")
_SHARD_BYTES = 4 << 30
_WEIGHT_FILES = ("model.safetensors.index.json",)


class Scheme(Protocol):
    """How a checkpoint is quantized: which Linears, into which tensors, under which quantization_config."""

    def quantizes(self, module: str) -> bool: ...

    def quantize(self, modules: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """[(a Linear's name, its weight)] -> the checkpoint's tensors of them [(name, tensor)]."""

    def save_config(self, dst: str) -> None:
        """Adds the scheme's quantization_config to dst's config.json."""


class Fp8Scheme:
    def __init__(self, config: Fp8Config):
        self.config = config

    def quantizes(self, module: str) -> bool:
        return self.config.quantizes(module)

    def quantize(self, modules: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for module, weight in modules:
            check_float(module, weight)
            q, scale = quantize_rows(weight, self.config.weight_strategy)
            out += [(f"{module}.weight", q), (f"{module}.weight_scale", scale)]
        return out

    def save_config(self, dst: str) -> None:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["quantization_config"] = self.config.to_dict()
        with open(path, "w") as f:
            json.dump(config, f, indent=2)


def quantize_checkpoint(src: str, dst: str, scheme: Scheme = Fp8Scheme(FP8_DYNAMIC)) -> str:
    """Write the checkpoint of `src` quantized by `scheme` into `dst` (created); -> dst."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src!r} is already quantized ({config['quantization_config'].get('quant_method')!r})")
    os.makedirs(dst, exist_ok=True)
    writer = _ShardWriter(dst)
    for file in checkpoint_files(src):
        modules = []
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                for out_name, tensor in _convert(name, f.get_tensor(name), scheme):
                    m = _LINEAR.fullmatch(out_name)
                    if out_name.startswith((DECODER, ENCODER)) and m and scheme.quantizes(m.group(1)):
                        modules.append((m.group(1), tensor))
                    else:
                        writer.add(out_name, tensor)
        for out_name, tensor in scheme.quantize(modules):
            writer.add(out_name, tensor)
    writer.close()
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and not entry.endswith(".safetensors") and entry not in _WEIGHT_FILES + ("config.json",):
            shutil.copy(path, os.path.join(dst, entry))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    scheme.save_config(dst)
    return dst


def _convert(name: str, tensor: torch.Tensor, scheme: Scheme):
    """One source tensor -> [(name, tensor)], the fused experts split into per-expert Linears' weights
    where the scheme quantizes them."""
    m = _FUSED_EXPERTS.fullmatch(name)
    if name.startswith((DECODER, ENCODER)) and m:
        prefix, kind = m.groups()
        per_expert = []
        for e, w in enumerate(tensor):
            halves = zip(("gate_proj", "up_proj"), w.chunk(2)) if kind == "gate_up_proj" else [("down_proj", w)]
            per_expert += [(f"{prefix}.{e}.{proj}", half) for proj, half in halves]
        targeted = [scheme.quantizes(module) for module, _ in per_expert]
        if all(targeted):
            return [(f"{module}.weight", w) for module, w in per_expert]
        if any(targeted):
            raise ValueError(f"the scheme quantizes only some of the experts in {name!r}")
    return [(name, tensor)]


def check_float(module: str, weight: torch.Tensor) -> None:
    if not weight.is_floating_point() or weight.element_size() < 2:
        raise ValueError(f"cannot quantize {module}.weight of dtype {weight.dtype}")


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
