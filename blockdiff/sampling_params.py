"""Sampling parameters of one request, their validation, and their defaults.

Unset diffusion parameters come from the checkpoint's generation_config.json, else from the
reference implementation's defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace

REFERENCE_DEFAULTS = {
    "max_tokens": 256,
    "max_denoising_steps": 48,
    "entropy_bound": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    draft: list[int] | None = None
    logprobs: int | None = None  # top logprobs per token; 0 returns only the chosen token's logprob
    stream_drafts: bool = False  # report the argmax canvas after every denoising step

    def __post_init__(self) -> None:
        _positive_int(self, "max_tokens")
        _positive_int(self, "max_denoising_steps")
        _positive_float(self, "entropy_bound")
        _non_negative_float(self, "t_min")
        _positive_float(self, "t_max")
        if self.t_min is not None and self.t_max is not None and self.t_max < self.t_min:
            raise ValueError(f"t_max must be >= t_min, got t_max={self.t_max} < t_min={self.t_min}")
        _int(self, "stability_threshold", minimum=0)
        _positive_float(self, "confidence_threshold")
        _int(self, "seed", minimum=None)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        _token_list(self, "stop_token_ids")
        _token_list(self, "draft")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.stream_drafts, bool):
            raise ValueError(f"stream_drafts must be a bool, got {self.stream_drafts!r}")
        _int(self, "logprobs", minimum=0)
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")

    def with_defaults(self, defaults: dict) -> "SamplingParams":
        """Fill unset fields from `defaults` (see `generation_defaults`), then re-validate."""
        filled = {f.name: defaults[f.name] for f in fields(self) if getattr(self, f.name) is None and f.name in defaults}
        return replace(self, **filled)


def generation_defaults(model_dir: str | None) -> dict:
    """Reference defaults overridden by the checkpoint's generation_config.json."""
    out = dict(REFERENCE_DEFAULTS)
    path = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if not path or not os.path.isfile(path):
        return out
    with open(path) as f:
        gen = json.load(f)
    for ours, theirs in (
        ("max_tokens", "max_new_tokens"),
        ("max_denoising_steps", "max_denoising_steps"),
        ("t_min", "t_min"),
        ("t_max", "t_max"),
        ("stability_threshold", "stability_threshold"),
        ("confidence_threshold", "confidence_threshold"),
    ):
        if gen.get(theirs) is not None:
            out[ours] = gen[theirs]
    sampler = gen.get("sampler_config") or {}
    if sampler.get("entropy_bound") is not None:
        out["entropy_bound"] = sampler["entropy_bound"]
    if gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]
        out["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(p: SamplingParams, name: str, minimum: int | None) -> None:
    v = getattr(p, name)
    if v is None:
        return
    if not _is_int(v) or (minimum is not None and v < minimum):
        bound = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {bound}, got {v!r}")


def _positive_int(p: SamplingParams, name: str) -> None:
    _int(p, name, minimum=1)


def _positive_float(p: SamplingParams, name: str) -> None:
    v = getattr(p, name)
    if v is not None and (not _is_number(v) or not v > 0 or v != v or v == float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _non_negative_float(p: SamplingParams, name: str) -> None:
    v = getattr(p, name)
    if v is not None and (not _is_number(v) or not v >= 0 or v == float("inf")):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


def _token_list(p: SamplingParams, name: str) -> None:
    v = getattr(p, name)
    if v is None:
        return
    if not isinstance(v, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in v):
        raise ValueError(f"{name} must be a list of non-negative token ids, got {v!r}")
    setattr(p, name, list(v))
