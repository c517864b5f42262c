"""The images of a prompt: checked against the engine's limits, decoded, preprocessed, and their
placeholders in the prompt expanded to one token per soft token. The engine takes images as
data (PIL images, encoded bytes, file paths); image URLs and chat messages' content parts are the
edge's (blockdiff/chat_parts.py)."""

from __future__ import annotations

from dataclasses import dataclass

from blockdiff.config import EngineConfig, ModelConfig
from blockdiff.image import ImageError, ImageLimits, ImageProcessor, ProcessedImage, as_image, expand_placeholders


@dataclass
class PromptImages:
    token_ids: list[int]  # the prompt with each image placeholder expanded
    images: list[ProcessedImage]
    spans: list[tuple[int, int]]  # [start, end) of each image's soft tokens


class ImageIntake:
    def __init__(self, cfg: EngineConfig, config: ModelConfig, processor: ImageProcessor | None):
        self.vision = config.vision
        self.processor = processor
        self.limit = cfg.limit_images_per_prompt
        self.limits = ImageLimits(cfg.max_image_bytes, cfg.max_image_pixels, cfg.max_image_decoded_bytes)

    @classmethod
    def from_pretrained(cls, cfg: EngineConfig, config: ModelConfig) -> "ImageIntake":
        return cls(cfg, config, ImageProcessor.from_pretrained(cfg.model) if config.vision else None)

    @property
    def enabled(self) -> bool:
        return self.vision is not None and self.processor is not None

    def check_count(self, n: int) -> None:
        """ValueError unless a prompt may hold `n` images; called before any of them is decoded."""
        if n and not self.enabled:
            why = "no vision tower" if self.vision is None else "no preprocessor_config.json"
            raise ImageError(f"this model does not take images: its checkpoint has {why}")
        if n > self.limit:
            raise ImageError(f"{n} images in one prompt, above the limit of {self.limit} (--limit-mm-per-prompt)")

    def load(self, sources: list, what: str = "image") -> list[ProcessedImage]:
        """PIL images, encoded bytes or file paths -> preprocessed images."""
        self.check_count(len(sources))
        return [s if isinstance(s, ProcessedImage) else self.processor(as_image(s, self.limits, f"{what} {i}"))
                for i, s in enumerate(sources)]

    def expand(self, ids: list[int], images: list[ProcessedImage]) -> PromptImages:
        v = self.vision
        if not images:
            if v is not None and v.image_token_id in ids:
                raise ImageError(f"the prompt holds the image placeholder token {v.image_token_id} but no image was given")
            return PromptImages(ids, [], [])
        ids, spans = expand_placeholders(ids, [im.num_soft_tokens for im in images], v.image_token_id,
                                         v.boi_token_id, v.eoi_token_id)
        return PromptImages(ids, images, spans)


def split_prompt(prompt) -> tuple[str | list[int], list | None]:
    """A prompt in vLLM's dict form ({"prompt": text or "prompt_token_ids": ids, "multi_modal_data":
    {"image": one image or a list}}) -> (text or ids, images); any other prompt -> (it, None)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids', and 'multi_modal_data'; got {sorted(prompt)}")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes 'image' only, got {data!r:.80}")
    images = data.get("image")
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]
    return prompt.get("prompt", prompt.get("prompt_token_ids")), images
