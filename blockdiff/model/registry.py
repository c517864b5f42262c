"""The architectures blockdiff runs, by the `architectures` name in a checkpoint's config.json."""

from __future__ import annotations

from blockdiff.config import ConfigError, ModelConfig, read_config_json
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.interface import BlockDiffusionModel

MODELS: dict[str, type[BlockDiffusionModel]] = {
    "DiffusionGemmaForBlockDiffusion": DiffusionGemma,
}
_MODEL_TYPES = {"diffusion_gemma": "DiffusionGemmaForBlockDiffusion"}  # configs that name no architecture
# The sampler each architecture denoises with unless EngineConfig.diffusion_sampler names another
# (blockdiff/diffusion/registry.py).
SAMPLERS: dict[str, str] = {
    "DiffusionGemmaForBlockDiffusion": "entropy_bound",
}


def architecture(raw: dict) -> str:
    names = raw.get("architectures") or [_MODEL_TYPES.get(raw.get("model_type"), raw.get("model_type"))]
    for name in names:
        if name in MODELS:
            return name
    raise ConfigError(f"unsupported architecture {names!r}: blockdiff runs {', '.join(MODELS)}")


def load_config(path: str) -> ModelConfig:
    """The checkpoint's config, checked to be of an architecture blockdiff runs."""
    raw = read_config_json(path)
    architecture(raw)
    return ModelConfig.from_dict(raw)


def model_class(config: ModelConfig) -> type[BlockDiffusionModel]:
    return MODELS[architecture(config.raw)]


def default_sampler(config: ModelConfig) -> str:
    return SAMPLERS[architecture(config.raw)]
