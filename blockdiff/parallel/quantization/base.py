"""The quantization-method interface, as vLLM's `QuantizationConfig.get_quant_method` gives it.

A checkpoint's quantization_config is parsed once (registry.py) into a `QuantConfig`, which hands
each layer its method by the checkpoint names of the layers it fuses. The layer keeps its geometry
(which rows and columns of a checkpoint tensor this rank holds); the method decides the rest:

- `create_weights` registers the layer's parameters, each with its `weight_loader` (the method's
  loaders, or the layer's own slicing where the method stores a tensor as the checkpoint does);
- `apply` multiplies, every forward.

The unquantized methods here are the plain weights. A format is one module implementing
`QuantConfig`, `LinearMethod` and `ExpertsMethod` (fp8.py, compressed_int.py), and one line in registry.py.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import torch
from torch import nn

from blockdiff.ops.kernels import ExpertRows, expert_linear, transposed_experts
from blockdiff.ops.matmul import linear


class QuantizationError(ValueError):
    """A quantization_config blockdiff cannot run."""


class LinearMethod(ABC):
    """The weights of a linear layer (blockdiff/parallel/layers.py)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        """Registers layer.weight ([out_features, in_features], this rank's) and its companions."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] times the layer's weight, transposed: [..., out], before any reduce."""


class ExpertsMethod(ABC):
    """The weights of a layer's experts (blockdiff/model/moe.py Experts)."""

    activations: str | None = None  # how the activations are quantized: the kernel choice weighs it (ops/kernels.py)

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the stored weights, for a model running `dtype` (their padding follows it)."""
        return dtype

    @abstractmethod
    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Registers layer.gate_up [E, 2W, H'] and layer.down [E, H', W] (`expert_weights`) and their companions."""

    @abstractmethod
    def apply(self, layer: nn.Module, projection: str, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        """x's rows, laid out by expert as `rows` says, times the experts' `projection` ("gate_up" or "down")."""


def match_rank(name: str, pattern: str) -> int:
    """How closely a compressed-tensors target or ignore entry names the linear layer `name`: 3 it is
    the name, 2 a regular expression ("re:...") matched from its start, 1 "Linear" (every linear
    layer), 0 no match."""
    if pattern == name:
        return 3
    if pattern.startswith("re:") and re.match(pattern[3:], name):
        return 2
    return 1 if pattern == "Linear" else 0


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether one of compressed-tensors' targets or ignore entries `patterns` names the linear layer `name`."""
    return any(match_rank(name, p) for p in patterns)


class QuantConfig(ABC):
    """One checkpoint's quantization_config, parsed."""

    @abstractmethod
    def linear_method(self, *names: str) -> LinearMethod | None:
        """The method of the linear layer fused from checkpoint layers `names`; None: unquantized."""

    @abstractmethod
    def experts_method(self, *names: str) -> ExpertsMethod | None:
        """The method of the experts whose per-expert checkpoint Linears are `names`; None: unquantized."""


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = layer.load_weight
        layer.weight.num_parts = layer.num_parts

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.weight)


def expert_weights(layer: nn.Module, dtype: torch.dtype) -> None:
    """layer.gate_up and layer.down, zeros of layer.shape's weight dtype, [E, out, in] like the
    checkpoint: each expert's slice is a plain linear weight (in memory [E, in, out] where the
    grouped kernel reads that faster: kernels.transposed_experts, for activations of `dtype`)."""
    e, w = layer.num_experts, layer.shape.weight_dtype
    transposed = transposed_experts(torch.get_default_device(), dtype, layer.shape)

    def weight(out: int, inner: int) -> nn.Parameter:
        t = torch.zeros(e, inner, out, dtype=w).transpose(1, 2) if transposed else torch.zeros(e, out, inner, dtype=w)
        return nn.Parameter(t, requires_grad=False)

    layer.gate_up, layer.down = weight(2 * layer.local, layer.hidden_in), weight(layer.hidden_in, layer.local)


class UnquantizedExpertsMethod(ExpertsMethod):
    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        expert_weights(layer, dtype)
        layer.gate_up.weight_loader = layer.load_gate_up
        layer.down.weight_loader = layer.load_down

    def apply(self, layer: nn.Module, projection: str, x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        return expert_linear(x, getattr(layer, projection), rows)


UNQUANTIZED_LINEAR = UnquantizedLinearMethod()
UNQUANTIZED_EXPERTS = UnquantizedExpertsMethod()


def linear_method(quant: QuantConfig | None, *names: str) -> LinearMethod:
    """The method of the linear layer fused from checkpoint layers `names` under `quant`."""
    method = None if quant is None else quant.linear_method(*names)
    return UNQUANTIZED_LINEAR if method is None else method


def experts_method(quant: QuantConfig | None, *names: str) -> ExpertsMethod:
    """The method of the experts whose per-expert checkpoint Linears are `names` under `quant`."""
    method = None if quant is None else quant.experts_method(*names)
    return UNQUANTIZED_EXPERTS if method is None else method
