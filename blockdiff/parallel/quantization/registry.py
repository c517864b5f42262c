"""The quantization formats blockdiff runs, by the `quant_method` of a checkpoint's quantization_config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockdiff.parallel.quantization import fp8
from blockdiff.parallel.quantization.base import QuantConfig, QuantizationError

FORMATS: dict[str, Callable[[dict[str, Any]], QuantConfig]] = {
    fp8.QUANT_METHOD: fp8.parse,
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
