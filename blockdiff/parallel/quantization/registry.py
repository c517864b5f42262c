"""The quantization formats blockdiff runs, by the `quant_method` of a checkpoint's quantization_config
(and, for compressed-tensors, by the `format` of its config groups)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockdiff.parallel.quantization import compressed_int, fp8, gptq
from blockdiff.parallel.quantization.base import QuantConfig, QuantizationError

Parser = Callable[[dict[str, Any]], QuantConfig]

COMPRESSED_TENSORS: dict[str, Parser] = {
    fp8.FORMAT: fp8.parse,
    compressed_int.FORMAT: compressed_int.parse,
}


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    """By the format of its config groups (each group's own, else the config's)."""
    groups = raw.get("config_groups") or {}
    if not groups:
        raise QuantizationError("quantization_config has no config_groups")
    formats = {g.get("format") or raw.get("format") for g in groups.values()}
    if len(formats) > 1:
        raise QuantizationError(f"compressed-tensors config groups in several formats {sorted(map(str, formats))} are "
                                "not supported")
    fmt, = formats
    if fmt not in COMPRESSED_TENSORS:
        raise QuantizationError(f"unsupported compressed-tensors format {fmt!r}, expected one of "
                                f"{', '.join(map(repr, COMPRESSED_TENSORS))}")
    return COMPRESSED_TENSORS[fmt](raw)


FORMATS: dict[str, Parser] = {
    fp8.QUANT_METHOD: _compressed_tensors,
    gptq.QUANT_METHOD: gptq.parse,
}


def parse_quantization(raw: dict[str, Any] | None) -> QuantConfig | None:
    """config.json's quantization_config -> its format's QuantConfig, or None for an unquantized checkpoint."""
    if raw is None:
        return None
    method = raw.get("quant_method")
    if method not in FORMATS:
        raise QuantizationError(f"unsupported quantization method {method!r}: blockdiff runs "
                                f"{', '.join(map(repr, FORMATS))} checkpoints only")
    return FORMATS[method](raw)
