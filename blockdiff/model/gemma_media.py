"""The image and video processors of a Gemma 4 vision checkpoint (DiffusionGemma's), made from the
engine's limits and the checkpoint's processor configs; model/registry.py registers them for the
architecture. Where the checkpoint cannot take the modality, what it lacks, for the error message."""

from __future__ import annotations

from blockdiff.config import EngineConfig, ModelConfig
from blockdiff.multimodal.image import ImageInput, ImageLimits, ImageProcessor
from blockdiff.multimodal.video import VideoInput, VideoLimits, VideoProcessor

VIDEO_TOKEN = "<|video|>"  # transformers' Gemma4Processor adds it to the tokenizer when it lacks it


def image_input(cfg: EngineConfig, config: ModelConfig, tokenizer) -> ImageInput | str:
    v = config.vision
    if v is None:
        return "no vision tower"
    processor = ImageProcessor.from_pretrained(cfg.model)
    if processor is None:
        return "no preprocessor_config.json"
    limits = ImageLimits(cfg.max_image_bytes, cfg.max_image_pixels, cfg.max_image_decoded_bytes)
    return ImageInput(processor, limits, cfg.limit_images_per_prompt, v.image_token_id, v.boi_token_id, v.eoi_token_id,
                      tokenizer.id_to_token if tokenizer is not None else None)


def video_input(cfg: EngineConfig, config: ModelConfig, tokenizer) -> VideoInput | str:
    v = config.vision
    if v is None:
        return "no vision tower"
    if tokenizer is None or v.boi_token_id is None or v.eoi_token_id is None:
        return "no tokenizer or no image start and end tokens (a frame's timestamp is text)"
    token = v.video_token_id if v.video_token_id is not None else tokenizer.token_to_id(VIDEO_TOKEN)
    if token is None:
        return f"no {VIDEO_TOKEN} token"
    processor = VideoProcessor.from_pretrained(cfg.model)
    if processor is None:
        return "no video_preprocessor_config.json"
    limits = VideoLimits(cfg.max_video_bytes, cfg.max_video_pixels, cfg.max_image_pixels, cfg.max_video_decoded_bytes)
    return VideoInput(processor, limits, cfg.limit_videos_per_prompt, token, v.boi_token_id, v.eoi_token_id,
                      lambda text: tokenizer.encode(text, add_special_tokens=False), tokenizer.id_to_token)

