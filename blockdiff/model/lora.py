"""LoRA adapters in PEFT's format, applied per token without merging (docs/lora.md): where an
adapter's names go in blockdiff's layers, reading and checking adapters, and writing them into the
pools of the LoRA layers (model/lora_layers.py) that replace the base layers when LoRA is enabled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from blockdiff.model.lora_layers import (
    DECODER, ENCODER, ColumnParallelLinearWithLoRA, ExpertsWithLoRA, LoRAError, RowParallelLinearWithLoRA,
)

# ---- where PEFT's names go -------------------------------------------------------------------------

# transformers' module names (as PEFT saves them, after "base_model.model.") -> (mode, layer or None
# for the self-conditioning MLP, what in blockdiff, which part of it).
_LAYER = re.compile(r"model\.(encoder\.language_model|decoder)\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj$")
_SELF_COND = re.compile(r"model\.decoder\.self_conditioning\.(gate|up|down)_proj$")
_PARTS = {"q": ("qkv_proj", 0), "k": ("qkv_proj", 1), "v": ("qkv_proj", 2), "o": ("o_proj", 0),
          "gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", 0)}


_EXPERTS = re.compile(r"model\.(encoder\.language_model|decoder)\.layers\.(\d+)\.experts((?:\.base_layer)*)$")
# transformers' experts register gate_up_proj first; PEFT wraps a module's targeted parameters in
# that order, the first innermost (saved as experts.base_layer.lora_A when both are targeted)
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def lora_pools(model: nn.Module) -> dict[tuple[int, str, str], nn.Module]:
    """The LoRA pools of `model` (its layers replaced: enable_lora) by (layer or -1 for the
    self-conditioning MLP, "self_attn" / "mlp" / "experts", the blockdiff linear's or the expert
    tensor's name), read off the replaced layers' names."""
    out = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, (ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA, ExpertsWithLoRA)):
            continue
        parts = name.split(".")
        at = int(parts[1]) if parts[0] == "layers" else -1
        if isinstance(layer, ExpertsWithLoRA):
            out[(at, "experts", "gate_up_proj")], out[(at, "experts", "down_proj")] = layer.lora_gate_up, layer.lora_down
        else:
            out[(at, "self_attn" if parts[-2] == "attn" else "mlp", parts[-1])] = layer.lora
    return out


def place(module: str, expert_params: list[str] | None = None) -> tuple[int, tuple[int, str, str], int]:
    """(mode, lora_pools key, part) of a transformers module name; LoRAError for one blockdiff cannot
    apply. expert_params: the expert tensors the adapter targets (PEFT's target_parameters)."""
    m = _LAYER.search(module)
    if m:
        mode = ENCODER if m.group(1).startswith("encoder") else DECODER
        name, part = _PARTS[m.group(4)]
        if m.group(3) == "self_attn" and m.group(4) in ("gate", "up", "down") or m.group(3) == "mlp" and m.group(4) in "qkvo":
            raise LoRAError(f"the adapter targets {module}, which blockdiff cannot apply")
        return mode, (int(m.group(2)), m.group(3), name), part
    m = _SELF_COND.search(module)
    if m:
        name, part = _PARTS[m.group(1)]
        return DECODER, (-1, "mlp", name), part
    m = _EXPERTS.search(module)
    if m and expert_params:
        depth = m.group(3).count("base_layer")
        if depth >= len(expert_params):
            raise LoRAError(f"the adapter has {module}, more nested than its target_parameters {expert_params}")
        mode = ENCODER if m.group(1).startswith("encoder") else DECODER
        return mode, (int(m.group(2)), "experts", expert_params[len(expert_params) - 1 - depth]), 0
    raise LoRAError(f"the adapter targets {module}, which blockdiff cannot apply (blockdiff applies LoRA to the "
                    "attention projections, the dense MLP, the experts and the self-conditioning MLP)")


# ---- adapters on the host ----------------------------------------------------------------------------

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class Fingerprint:
    """Who an adapter is: each of its files' (size, mtime in ns, SHA-256 of the bytes read)."""

    files: tuple[tuple[int, int, str], ...]

    def stat_matches(self, path: str) -> bool:
        """Whether the files' sizes and mtimes are still those (a stat each, no read)."""
        try:
            now = [os.stat(os.path.join(path, name)) for name in ADAPTER_FILES]
        except OSError:
            return False
        return [(st.st_size, st.st_mtime_ns) for st in now] == [f[:2] for f in self.files]


def fingerprint(path: str) -> Fingerprint:
    """The fingerprint of the adapter files at `path` as they are now (LoRAError when unreadable)."""
    return _read_files(path)[1]


def _read_files(path: str) -> tuple[list[bytes], Fingerprint]:
    """The adapter's files, each read once: the fingerprint is of the very bytes parsed."""
    data, files = [], []
    for name in ADAPTER_FILES:
        try:
            with open(os.path.join(path, name), "rb") as f:
                st = os.fstat(f.fileno())
                data.append(f.read())
        except FileNotFoundError:
            raise LoRAError(f"no {name}" + (" (blockdiff reads adapters in safetensors only)"
                                            if name.endswith(".safetensors") else "")) from None
        except OSError as e:
            raise LoRAError(f"cannot read {name} ({e.strerror or type(e).__name__})") from None
        files.append((st.st_size, st.st_mtime_ns, hashlib.sha256(data[-1]).hexdigest()))
    return data, Fingerprint(tuple(files))


@dataclass
class Adapter:
    """An adapter read from disk: per (mode, layer key, part), its A, B and scale; the fingerprint
    of the files they were read from."""

    path: str
    rank: int
    deltas: dict[tuple[int, tuple[int, str, str], int], tuple[torch.Tensor, torch.Tensor, float, str]]
    fingerprint: Fingerprint

    @property
    def experts(self) -> bool:
        """Whether it targets the experts (a step with such an adapter runs the experts' pools)."""
        return any(key[1] == "experts" for _, key, _ in self.deltas)


def read_adapter(path: str, max_rank: int | None = None, expect: Fingerprint | None = None) -> Adapter:
    """PEFT's adapter at `path`, checked: a LoRAError says what blockdiff cannot read or apply (the
    caller names the adapter; no message quotes the config's values). `expect`: the fingerprint the
    files must still have (LoRAError if they changed)."""
    (config_bytes, weights), found = _read_files(path)
    if expect is not None and found != expect:
        raise LoRAError("its files changed on disk since it was loaded")
    try:
        cfg = json.loads(config_bytes)
    except ValueError:  # UnicodeDecodeError too
        raise LoRAError("adapter_config.json is not JSON") from None
    if not isinstance(cfg, dict):
        raise LoRAError("adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError("peft_type is not LORA, the only kind blockdiff serves")
    for key, ok in (("use_dora", False), ("bias", "none"), ("lora_bias", False), ("modules_to_save", None),
                    ("trainable_token_indices", None)):
        if cfg.get(key, ok) not in (ok, [], {}):
            raise LoRAError(f"{key} is not supported")
    if cfg.get("layer_replication"):
        raise LoRAError("layer_replication is not supported")
    alpha, rslora, default_rank = cfg.get("lora_alpha", 8), cfg.get("use_rslora", False), cfg.get("r", 8)
    alpha_pattern, rank_pattern = cfg.get("alpha_pattern") or {}, cfg.get("rank_pattern") or {}
    targets = cfg.get("target_parameters") or []
    if not (_number(alpha) and isinstance(rslora, bool) and _positive(default_rank) and isinstance(targets, list)
            and isinstance(alpha_pattern, dict) and isinstance(rank_pattern, dict)
            and all(_number(v) for v in alpha_pattern.values()) and all(_positive(v) for v in rank_pattern.values())):
        raise LoRAError("adapter_config.json: r, lora_alpha, use_rslora, alpha_pattern, rank_pattern or "
                        "target_parameters has a value of the wrong type")
    for target in targets:
        owner, _, param = target.rpartition(".") if isinstance(target, str) else ("", "", "")
        if param not in EXPERT_PARAMS or not (owner == "experts" or owner.endswith(".experts")):
            raise LoRAError(f"target_parameters: blockdiff applies LoRA to the experts' "
                            f"{' and '.join(EXPERT_PARAMS)} only")

    def pattern(patterns: dict, name: str, default):
        for key, value in patterns.items():
            try:
                if re.search(rf"(^|\.){key}$", name):
                    return value
            except re.error:
                raise LoRAError("alpha_pattern or rank_pattern has a key that is not a regular expression") from None
        return default

    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        loaded = load(weights)
    except SafetensorError as e:
        raise LoRAError(f"adapter_model.safetensors cannot be read: {e}") from None
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in loaded.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise LoRAError(f"tensor {key[:200]!r} is not a LoRA weight blockdiff can apply")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoRAError(f"tensor {key[:200]!r} is not a 2-D floating-point matrix")
        tensors.setdefault(m.group(1), {})[m.group(2)] = tensor
    deltas = {}
    top = 0
    for module, ab in sorted(tensors.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAError(f"{module} lacks {({'lora_A', 'lora_B'} - set(ab)).pop()}")
        owner = re.sub(r"(\.base_layer)+$", "", module)
        targeted = [p for p in EXPERT_PARAMS if any(f"{owner}.{p}".endswith(t) for t in targets)]
        mode, key, part = place(module, targeted)
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[0]
        if key[1] == "experts":  # A holds every expert's r rows: the rank is the config's
            module = f"{owner}.{key[2]}"
            r = pattern(rank_pattern, module, default_rank)
        if r < 1:
            raise LoRAError(f"{module} has rank 0 (lora_A has no rows)")
        if max_rank is not None and r > max_rank:
            raise LoRAError(f"{module} has rank {r}, more than --max-lora-rank {max_rank}")
        top = max(top, r)
        scale = pattern(alpha_pattern, module, alpha) / (r**0.5 if rslora else r)
        deltas[(mode, key, part)] = (a, b, scale, module)
    return Adapter(path, top, deltas, found)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_fits(adapter: Adapter, config) -> None:
    """LoRAError unless every delta of `adapter` fits the model of GemmaConfig `config` (a layer it
    has, the projection's shape): checked when a request names it, so that a step never meets it."""
    h, heads, inter = config.hidden_size, config.num_heads, config.intermediate_size
    for (_, (layer, block, name), part), (a, b, _, module) in adapter.deltas.items():
        if layer >= len(config.layers):
            raise LoRAError(f"the adapter targets {module}, but the model has {len(config.layers)} layers")
        if block == "experts":
            e, i = config.num_experts, config.moe_intermediate_size
            out, inp = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}[name]
            if a.shape[0] % e or a.shape[1] != inp or b.shape[0] != out or b.shape[1] != a.shape[0]:
                raise LoRAError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the model's "
                                f"{e} experts ([{e} x r, {inp}] / [{out}, r x {e}])")
            continue
        if layer < 0 or block == "mlp":
            shape = {"gate_up_proj": (inter, h), "down_proj": (h, inter)}[name]
        else:
            spec = config.layers[layer]
            if part == 2 and not spec.has_v_proj:
                raise LoRAError(f"the adapter targets {module}, which this checkpoint does not have (no v_proj in that layer)")
            if name == "o_proj":
                shape = (h, heads * spec.head_dim)
            else:  # q, k, v
                shape = ((heads if part == 0 else spec.num_kv_heads) * spec.head_dim, h)
        out, inp = shape
        if a.shape[1] != inp or b.shape[0] != out or b.shape[1] != a.shape[0]:
            raise LoRAError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the model "
                            f"([r, {inp}] / [{out}, r])")


def put_adapter(model: nn.Module, slot: int, adapter: Adapter | None) -> None:
    """Writes `adapter` into pool slot `slot` of every LoRA layer (None: clears it). Every delta is
    checked before the first write: an adapter that does not fit leaves the slot empty, never half
    written (a request running on it would get weights of no adapter)."""
    pools = lora_pools(model)
    try:
        for (_, key, part), (a, b, _, name) in (adapter.deltas.items() if adapter is not None else ()):
            if key not in pools:
                raise LoRAError(f"the adapter targets {name}, but the model has no such layer")
            pools[key].check(part, a, b, name)
    finally:
        for pool in pools.values():
            pool.clear(slot)
    if adapter is None:
        return
    for (mode, key, part), (a, b, scale, name) in adapter.deltas.items():
        pools[key].put(slot, mode, part, a, b, scale, name)


class AdapterCache:
    """Adapters read from disk, kept in host memory (the --max-cpu-loras most recently used), each
    under the fingerprint of the files it was read from: one read again (evicted, or asked for under
    another fingerprint) must come from files of the fingerprint asked for."""

    def __init__(self, capacity: int, max_rank: int | None = None):
        self.capacity, self.max_rank = max(1, capacity), max_rank
        self.entries: OrderedDict[str, Adapter] = OrderedDict()

    def get(self, path: str, expect: Fingerprint | None = None) -> Adapter:
        """The adapter at `path` whose files have the fingerprint `expect` (None: as they are now)."""
        cached = self.entries.get(path)
        if cached is not None and expect in (None, cached.fingerprint):
            self.entries.move_to_end(path)
            return cached
        self.entries.pop(path, None)
        adapter = read_adapter(path, self.max_rank, expect)
        self.entries[path] = adapter
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return adapter
