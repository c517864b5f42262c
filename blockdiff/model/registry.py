"""The architectures blockdiff runs, by the `architectures` name in a checkpoint's config.json:
each brings its model class, its checkpoint format (config.json parsing, tensor names) and the
diffusion sampler it denoises with unless EngineConfig.diffusion_sampler names another
(blockdiff/diffusion/registry.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from blockdiff.config import ConfigError, ModelConfig, read_config_json
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.gemma_checkpoint import GemmaCheckpoint
from blockdiff.model.gemma_media import image_input, video_input
from blockdiff.model.interface import BlockDiffusionModel, CheckpointFormat


@dataclass(frozen=True)
class Architecture:
    model: type[BlockDiffusionModel]
    checkpoint: CheckpointFormat
    sampler: str  # the diffusion sampler's name
    # modality -> (engine config, model config, tokenizer) -> its processor (blockdiff.multimodal), or
    # a string saying what the checkpoint lacks to take it
    processors: dict[str, Callable] = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {
    "DiffusionGemmaForBlockDiffusion": Architecture(DiffusionGemma, GemmaCheckpoint(), "entropy_bound",
                                                    {"image": image_input, "video": video_input}),
}
_MODEL_TYPES = {"diffusion_gemma": "DiffusionGemmaForBlockDiffusion"}  # configs that name no architecture


def architecture(raw: dict) -> str:
    names = raw.get("architectures") or [_MODEL_TYPES.get(raw.get("model_type"), raw.get("model_type"))]
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ConfigError(f"unsupported architecture {names!r}: blockdiff runs {', '.join(ARCHITECTURES)}")


def parse_config(raw: dict) -> ModelConfig:
    """config.json's contents, parsed by their architecture."""
    return ARCHITECTURES[architecture(raw)].checkpoint.parse_config(raw)


def load_config(path: str) -> ModelConfig:
    """The checkpoint's config (a directory, or a config.json file alone), of an architecture
    blockdiff runs."""
    return parse_config(read_config_json(path))


def architecture_of(config: ModelConfig) -> Architecture:
    return ARCHITECTURES[config.architecture]


def model_class(config: ModelConfig) -> type[BlockDiffusionModel]:
    return architecture_of(config).model


def default_sampler(config: ModelConfig) -> str:
    return architecture_of(config).sampler
