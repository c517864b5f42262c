"""Image preprocessing without transformers, equal to transformers' Gemma 4 image processor, and
the decoder's errors."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from blockdiff.multimodal import MediaError, expand_placeholders
from blockdiff.multimodal.image import ImageError, ImageInput, ImageLimits, ImageProcessor, ProcessedImage, as_image, decode_image
from blockdiff.model.tiny import PREPROCESSOR


def picture(h: int, w: int, seed: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x * y) % 256, 128 + 0 * x], -1)
    rgba = np.clip(base + rng.randint(-30, 30, (h, w, 4)), 0, 255).astype(np.uint8)
    rgba[..., 3] = rng.randint(0, 256, (h, w))  # real transparency, composited over white
    return Image.fromarray(rgba, "RGBA").convert(mode)


def _config_dir(tmp_path, **overrides) -> str:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, **overrides}))
    return str(tmp_path)


def _assert_same(ours: ImageProcessor, theirs, image: Image.Image) -> None:
    want = theirs([image], return_tensors="pt")
    got = ours(image)
    n = got.pixel_values.shape[0]
    assert got.num_soft_tokens == want["num_soft_tokens_per_image"][0] == n // ours.pooling_kernel_size**2
    assert torch.equal(got.pixel_values, want["pixel_values"][0, :n])
    assert torch.equal(got.position_ids, want["image_position_ids"][0, :n])
    # what transformers adds after the image is padding only
    assert not want["pixel_values"][0, n:].any() and (want["image_position_ids"][0, n:] == -1).all()


LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20)
SIZES = [(40, 30), (24, 60), (7, 90), (90, 7), (300, 200), (5, 5), (48, 48), (1, 400)]


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_pixels_and_positions_equal_transformers(tmp_path, mode):
    path = _config_dir(tmp_path)
    ours, theirs = ImageProcessor.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    for i, (h, w) in enumerate(SIZES):
        _assert_same(ours, theirs, picture(h, w, seed=i, mode=mode))


def test_other_settings_equal_transformers(tmp_path):
    path = _config_dir(tmp_path, patch_size=4, pooling_kernel_size=2, max_soft_tokens=140, resample=2,
                       do_normalize=True, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    ours, theirs = ImageProcessor.from_pretrained(path), AutoImageProcessor.from_pretrained(path)
    assert (ours.patch_size, ours.pooling_kernel_size, ours.do_normalize) == (4, 2, True)
    for i, (h, w) in enumerate(SIZES[:5]):
        _assert_same(ours, theirs, picture(h, w, seed=10 + i))


def test_a_checkpoint_without_a_preprocessor_config_has_no_processor(tmp_path):
    assert ImageProcessor.from_pretrained(str(tmp_path)) is None


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_bytes_paths_and_images_decode_to_the_same_pixels(tmp_path):
    image = picture(20, 30, 0)
    data = _encoded(image, "PNG")
    (tmp_path / "a.png").write_bytes(data)
    for source in (image, data, str(tmp_path / "a.png"), tmp_path / "a.png"):
        assert np.array_equal(np.array(as_image(source, LIMITS).convert("RGB")), np.array(image.convert("RGB")))


@pytest.mark.parametrize(
    "data, limits, message",
    [
        (_encoded(picture(20, 30, 0), "PNG")[:120], LIMITS, "corrupt"),
        (_encoded(picture(20, 30, 0), "TIFF"), LIMITS, "unsupported format TIFF"),
        (b"hello, I am text", LIMITS, "not an image"),
        (_encoded(picture(20, 30, 0), "PNG"), ImageLimits(max_bytes=100, max_pixels=1 << 20), "above the limit of 100"),
        (_encoded(picture(20, 30, 0), "PNG"), ImageLimits(max_bytes=1 << 20, max_pixels=599),
         "600 pixels, above the limit of 599"),
    ],
    ids=["corrupt", "format", "not-an-image", "bytes", "pixels"],
)
def test_bad_images_are_errors_naming_the_problem(data, limits, message):
    with pytest.raises(ImageError, match=message):
        decode_image(data, limits)


def test_placeholders_expand_as_the_processor_does():
    intake = ImageInput(ImageProcessor(), ImageLimits(1, 1), 4, placeholder=9, boi=7, eoi=8)
    items = [intake.item(ProcessedImage(torch.zeros(n, 12), torch.zeros(n, 2), n, bytes([n]))) for n in (3, 1)]
    ids, runs = expand_placeholders([2, 5, 9, 6, 9], items, {"image": 9})
    assert ids == [2, 5, 7, 9, 9, 9, 8, 6, 7, 9, 8]
    assert [(r.start, r.end) for r in runs] == [(3, 6), (9, 10)]
    with pytest.raises(MediaError, match="2 image placeholders for 1 images"):
        expand_placeholders([9, 9], items[:1], {"image": 9})
