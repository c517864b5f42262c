"""The diffusion samplers blockdiff runs, by name (`EngineConfig.diffusion_sampler`)."""

from __future__ import annotations

from blockdiff.diffusion.confidence_threshold import ConfidenceThreshold
from blockdiff.diffusion.entropy_bound import EntropyBound
from blockdiff.diffusion.strategy import DiffusionSampler

SAMPLERS: dict[str, type[DiffusionSampler]] = {s.name: s for s in (
    EntropyBound,
    ConfidenceThreshold,
)}


def make_sampler(name: str) -> DiffusionSampler:
    if name not in SAMPLERS:
        raise ValueError(f"diffusion_sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")
    return SAMPLERS[name]()
