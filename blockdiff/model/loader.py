"""Load a Hugging Face checkpoint (safetensors only) into the model of its architecture, by the
architecture's tensor names (its `CheckpointFormat`, model/registry.py).

Each rank reads only its own slices: a tensor is opened lazily and each parameter's weight_loader
takes the rows or columns it owns.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from blockdiff.config import ModelConfig
from blockdiff.model.interface import BlockDiffusionModel, CheckpointFormat
from blockdiff.model.registry import architecture_of, load_config
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.layers import replicated_loader

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    pass


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


def load_weights(model: nn.Module, path: str, fmt: CheckpointFormat) -> None:
    """Every parameter of `model` from checkpoint `path`, by its architecture's tensor names (`fmt`).
    Errors name the missing, unexpected and mis-shaped tensors."""
    files = checkpoint_files(path)
    fmt.prepare(model, files)
    params = dict(model.named_parameters())
    # Optional tensors, loaded where the checkpoint has them (an FP8 KV cache's k_scale / v_scale).
    params.update((name, b) for name, b in model.named_buffers() if hasattr(b, "weight_loader"))
    seen_second, seen, unexpected = {}, set(), []
    for file in tqdm(files, desc="Loading checkpoint shards", unit="shard", disable=len(files) < 2):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if fmt.ignored(model, name):
                    continue
                mapped = fmt.map_name(name)
                if mapped is None or mapped[0] not in params:
                    unexpected.append(name)
                    continue
                target, part = mapped
                if part is not None and part >= getattr(params[target], "num_parts", 1):
                    unexpected.append(name)  # e.g. v_proj on a layer whose keys are its values
                    continue
                key = (target, part)
                if fmt.secondary(name, target):  # loaded only where no first spelling comes
                    seen_second[key] = (file, name)
                    continue
                _load_one(params[target], f.get_slice(name), name, part)
                seen.add(key)
    for key, (file, name) in seen_second.items():
        if key not in seen:
            with safe_open(file, framework="pt") as f:
                _load_one(params[key[0]], f.get_slice(name), name, key[1])
            seen.add(key)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in checkpoint {path!r}: {', '.join(sorted(unexpected))}")
    missing = sorted(_expected_keys(model) - seen)
    if missing:
        names = [f"{t}[part {p}]" if p is not None else t for t, p in missing]
        raise CheckpointError(f"tensors missing from checkpoint {path!r}: {', '.join(names)}")


def _load_one(param: torch.Tensor, source, name: str, part: int | None) -> None:
    # Parameters whose layer does not shard them (norms, scalars, the router) are copied whole.
    load = getattr(param, "weight_loader", replicated_loader)
    if part is None:
        load(param, source, name)
    else:
        load(param, source, name, part)


def _expected_keys(model: nn.Module) -> set[tuple[str, int | None]]:
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
) -> BlockDiffusionModel:
    """The model of checkpoint `path`, of its architecture (model/registry.py); load_format "dummy"
    reads only its config.json and fills the weights with small random values (timing and memory
    runs at real shapes without the file)."""
    config = config or load_config(path)
    arch = architecture_of(config)
    with torch.device(device):
        model = arch.model(config, group=group, dtype=dtype)
    if load_format == "dummy":
        dummy_weights(model)
    else:
        load_weights(model, path, arch.checkpoint)
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
