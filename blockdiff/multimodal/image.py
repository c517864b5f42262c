"""Images into model inputs, without transformers: decoding (Pillow), the Gemma 4 image processor,
and the image modality's processor (`ImageInput`), whose items replace each image placeholder.

The processor follows the checkpoint's preprocessor_config.json as transformers' Gemma 4 image
processor (its Pillow backend) does: convert to RGB (transparent pixels over white), resize with
the aspect ratio kept to the largest size whose sides are multiples of pooling_kernel_size *
patch_size and that holds at most max_soft_tokens * pooling_kernel_size**2 patches, rescale,
normalize, cut into patches in row-major order. Each image gives its patches [patches,
3 * patch_size**2] and their (x, y) grid positions, without the padding to a fixed count that
transformers adds for batching; it becomes patches / pooling_kernel_size**2 soft tokens.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from blockdiff.multimodal import MediaError, MultiModalItem, pixel_digest

# What the reference processor accepts as max_soft_tokens.
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(MediaError):
    """An image that cannot be used; the message names the problem."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int  # of an encoded image
    max_pixels: int  # width x height
    max_decoded_bytes: int = 64 * 2**20  # width x height x 4: what Pillow holds of it decoded, and converted


# What Pillow raises on data it cannot decode: truncated, corrupt, or a header it refuses outright.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError)


def decode_image(data: bytes, limits: ImageLimits, what: str = "image") -> Image.Image:
    """Encoded bytes -> a loaded PIL image, or ImageError saying why not. The header's size is
    checked against the limits before any pixel is decoded."""
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what} is {len(data)} bytes, above the limit of {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"{what} is not an image in a known format (supported: {', '.join(FORMATS)})") from None
    except Image.DecompressionBombError:  # Pillow's own bound (twice Image.MAX_IMAGE_PIXELS), at open
        raise ImageError(f"{what} claims a size above the limit of {limits.max_pixels} pixels") from None
    except _DECODE_ERRORS as e:
        raise ImageError(f"{what} is corrupt: {e}") from None
    if image.format not in FORMATS:
        raise ImageError(f"{what} has the unsupported format {image.format}; supported: {', '.join(FORMATS)}")
    check_pixels(image, limits, what)
    try:
        image.load()
        # as transformers' and vLLM's loaders do: the orientation the camera recorded
        return ImageOps.exif_transpose(image)
    except _DECODE_ERRORS as e:  # Pillow's errors for truncated or broken data
        raise ImageError(f"{what} is corrupt: {e}") from None


def check_pixels(image: Image.Image, limits: ImageLimits, what: str = "image") -> None:
    w, h = image.size
    if w * h > limits.max_pixels:
        raise ImageError(f"{what} has {w}x{h} = {w * h} pixels, above the limit of {limits.max_pixels}")
    if w < 1 or h < 1:
        raise ImageError(f"{what} is empty ({w}x{h})")
    # Pillow keeps 4 bytes a pixel of RGB(A), and the processor converts every mode to them.
    decoded = w * h * 4
    if decoded > limits.max_decoded_bytes:
        raise ImageError(f"{what} ({w}x{h}) decodes to {decoded} bytes, above the limit of {limits.max_decoded_bytes} "
                         "(--max-image-decoded-bytes); send it smaller")


def as_image(source, limits: ImageLimits, what: str = "image") -> Image.Image:
    """A PIL image, encoded bytes or a file path -> a PIL image."""
    if isinstance(source, Image.Image):
        check_pixels(source, limits, what)
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), limits, what)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ImageError(f"{what}: no such file {path!r}")
        size = os.path.getsize(path)
        if size > limits.max_bytes:
            raise ImageError(f"{what} {path!r} is {size} bytes, above the limit of {limits.max_bytes}")
        with open(path, "rb") as f:
            return decode_image(f.read(), limits, f"{what} {path!r}")
    raise ImageError(f"{what} must be a PIL image, bytes or a file path, not {type(source).__name__}")


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [patches, 3 * patch_size**2] float32
    position_ids: torch.Tensor  # [patches, 2] long, (x, y)
    num_soft_tokens: int
    digest: bytes  # of the pixels and positions: equal images share prefix-cache blocks


def fit_size(height: int, width: int, patch_size: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """The reference's aspect-ratio-preserving target size (see the module docstring)."""
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling * patch_size
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pooling**2) * side
    if th == 0 and tw == 0:
        raise ImageError(f"a {width}x{height} image cannot be resized to a multiple of {side} pixels")
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        th, tw = min(int(math.floor(height / width)) * side, longest), side
    if th * tw > target_px:
        raise ImageError(f"a {width}x{height} image resizes to {tw}x{th}, more than {max_patches} patches")
    return th, tw


def processor_config(cls: type, path: str, own_file: str, key: str):
    """A processor dataclass `cls` from the checkpoint's `own_file`, else processor_config.json's
    `key` entry (transformers reads them so); None when it has neither. Means and deviations may be
    one number for every channel."""
    raw = None
    for name, entry in ((own_file, None), ("processor_config.json", key)):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                raw = json.load(f)
            raw = raw.get(entry) if entry else raw
            if raw:
                break
    if not raw:
        return None
    fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
    for k in ("image_mean", "image_std"):
        if k in fields:
            v = fields[k]
            fields[k] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
    proc = cls(**fields)
    if proc.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
        raise ValueError(f"{path}: max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {proc.max_soft_tokens}")
    return proc

@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True

    @classmethod
    def from_pretrained(cls, path: str) -> "ImageProcessor | None":
        """The checkpoint's preprocessor_config.json (processor_config.json's "image_processor"
        entry otherwise); None when it has neither."""
        return processor_config(cls, path, "preprocessor_config.json", "image_processor")

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    def __call__(self, image: Image.Image) -> ProcessedImage:
        if self.do_convert_rgb:
            image = _rgb(image)
        arr = np.array(image)
        if arr.ndim == 2:
            arr = arr[..., None]
        h, w = arr.shape[:2]
        if self.do_resize:
            th, tw = fit_size(h, w, self.patch_size, self.max_patches, self.pooling_kernel_size)
            if (th, tw) != (h, w):
                resized = Image.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr).resize((tw, th), resample=self.resample)
                arr = np.array(resized)
                arr = arr[..., None] if arr.ndim == 2 else arr
                h, w = th, tw
        return self.patches(arr)

    def patches(self, arr: np.ndarray) -> ProcessedImage:
        """A resized [H, W, C] uint8 array -> rescaled, normalized patches and their positions."""
        h, w = arr.shape[:2]
        x = arr.astype(np.float64) * self.rescale_factor if self.do_rescale else arr
        x = x.astype(np.float32)
        if self.do_normalize:
            x = (x - np.array(self.image_mean, np.float32)) / np.array(self.image_std, np.float32)
        p = self.patch_size
        ph, pw = h // p, w // p
        c = x.shape[-1]
        # [H, W, C] -> [ph, p, pw, p, C] -> [ph, pw, p, p, C]: a patch is its rows, each its pixels' channels
        patches = x[: ph * p, : pw * p].reshape(ph, p, pw, p, c).transpose(0, 2, 1, 3, 4).reshape(ph * pw, p * p * c)
        grid_y, grid_x = np.meshgrid(np.arange(ph), np.arange(pw), indexing="ij")
        positions = np.stack([grid_x, grid_y], -1).reshape(-1, 2)
        pixels = torch.from_numpy(np.ascontiguousarray(patches))
        pos = torch.from_numpy(positions.astype(np.int64))
        return ProcessedImage(pixels, pos, (ph * pw) // self.pooling_kernel_size**2, pixel_digest(pixels, pos))


def _rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageInput:
    """The image modality's processor: a PIL image, encoded bytes or a file path -> an item of one
    run, <boi>, one image token per soft token, <eoi>, as the checkpoint's processor expands the
    image token that the chat template writes."""

    processor: ImageProcessor
    limits: ImageLimits
    limit: int  # images one prompt may hold
    placeholder: int  # the image token
    boi: int | None
    eoi: int | None
    token_text: object = None  # token id -> its text (the tokenizer's), for text prompts; None without one
    modality = "image"

    @property
    def max_bytes(self) -> int:
        return self.limits.max_bytes

    def load(self, source, what: str = "image") -> MultiModalItem:
        if isinstance(source, MultiModalItem):
            return source
        return self.item(self.processor(as_image(source, self.limits, what)))

    def item(self, image: ProcessedImage) -> MultiModalItem:
        n = image.num_soft_tokens
        head = [] if self.boi is None else [self.boi]
        tail = [] if self.eoi is None else [self.eoi]
        tokens = tuple(head + [self.placeholder] * n + tail)
        text = "".join(map(self.token_text, tokens)) if self.token_text else None
        return MultiModalItem("image", (image.pixel_values,), (image.position_ids,), tokens,
                              ((len(head), len(head) + n),), image.digest, text)
