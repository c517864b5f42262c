"""Videos into model inputs, without transformers: decoding (PyAV), frame sampling and the Gemma 4
video processor, and the video modality's processor (`VideoInput`).

As transformers' Gemma4VideoProcessor and Gemma4Processor do it: `num_frames` frames sampled
uniformly (indices i * total // num_frames), each resized like an image but with torchvision's
antialiased bicubic rather than Pillow's, rescaled and normalized (fused, in float32), cut into
patches; the video placeholder becomes, per frame, its timestamp "MM:SS", a space, <boi>, one video
token per soft token, <eoi>, the frames joined by spaces. Each frame is one run of soft tokens that
the vision tower encodes as an image.

Bounds: the container's header is read first (a frame's size, the frame count: the pixels to
decode, and the sampled frames' size once decoded) and checked against the limits before any frame
is decoded; frames are decoded one after another up to the last sampled one, and only the sampled
ones are kept.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from blockdiff.multimodal import MediaError, MultiModalItem, pixel_digest
from blockdiff.multimodal.image import fit_size, processor_config


class VideoError(MediaError):
    """A video that cannot be used; the message names the problem."""

    code = "invalid_video"


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int  # of an encoded video
    max_pixels: int  # frames x width x height: every frame up to the last one sampled is decoded
    max_frame_pixels: int  # width x height of one frame
    max_decoded_bytes: int  # the sampled frames decoded: frames x width x height x 3


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray  # [sampled, H, W, 3] uint8
    fps: float
    indices: list[int]  # of the sampled frames

    @property
    def timestamps(self) -> list[float]:
        return [i / self.fps for i in self.indices]


def sample_indices(total: int, num_frames: int) -> list[int]:
    """transformers' default_sample_indices_fn; it refuses a video of fewer frames than num_frames,
    where this takes them all."""
    n = min(num_frames, total)
    return [i * total // n for i in range(n)]


def decode_video(data: bytes, limits: VideoLimits, num_frames: int, what: str = "video") -> DecodedVideo:
    """Encoded bytes -> the sampled frames, or VideoError saying why not. The header's frame size
    and count are checked against the limits before any frame is decoded."""
    import av  # PyAV, FFmpeg's decoders; imported here so that text-only use never loads it

    if len(data) > limits.max_bytes:
        raise VideoError(f"{what} is {len(data)} bytes, above the limit of {limits.max_bytes} (--max-video-bytes)")
    try:
        container = av.open(io.BytesIO(data))
    except (av.FFmpegError, ValueError, OSError) as e:
        raise VideoError(f"{what} is not a video in a format FFmpeg reads: {type(e).__name__}") from None
    with container:
        if not container.streams.video:
            raise VideoError(f"{what} has no video stream")
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        total = stream.frames
        if not total and container.duration and fps:  # containers that store no count (WebM): from the duration
            total = int(container.duration / av.time_base * fps)
        if w < 1 or h < 1 or total < 1 or fps <= 0:
            raise VideoError(f"{what}: its header gives no frame size, frame count or frame rate ({w}x{h}, {total} frames, "
                             f"{fps:g} fps)")
        if w * h > limits.max_frame_pixels:
            raise VideoError(f"{what} has {w}x{h} = {w * h} pixels a frame, above the limit of {limits.max_frame_pixels} "
                             "(--max-image-pixels)")
        if total * w * h > limits.max_pixels:
            raise VideoError(f"{what} ({total} frames of {w}x{h}) is {total * w * h} pixels to decode, above the limit of "
                             f"{limits.max_pixels} (--max-video-pixels); send it shorter or smaller")
        indices = sample_indices(total, num_frames)
        decoded = len(indices) * w * h * 3
        if decoded > limits.max_decoded_bytes:
            raise VideoError(f"{what} ({total} frames of {w}x{h}, {len(indices)} sampled) decodes to {decoded} bytes, above "
                             f"the limit of {limits.max_decoded_bytes} (--max-video-decoded-bytes); send it smaller")
        wanted, frames = set(indices), []
        try:
            for i, frame in enumerate(container.decode(stream)):
                if i > indices[-1]:
                    break
                if i not in wanted:
                    continue
                if (frame.width, frame.height) != (w, h):  # the header's size is what was checked
                    raise VideoError(f"{what}: frame {i} is {frame.width}x{frame.height}, not the {w}x{h} of its header")
                frames.append(frame.to_ndarray(format="rgb24"))
        except (av.FFmpegError, ValueError, OSError) as e:
            raise VideoError(f"{what} is corrupt: {type(e).__name__}") from None
    if len(frames) < len(indices):
        raise VideoError(f"{what} holds fewer frames than the {total} its header claims")
    return DecodedVideo(np.stack(frames), fps, indices)


_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's numbers, as preprocessor configs give them


@dataclass(frozen=True)
class VideoProcessor:
    """The checkpoint's video_preprocessor_config.json (transformers' Gemma4VideoProcessor, whose
    defaults these are)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 70
    num_frames: int = 32
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    @classmethod
    def from_pretrained(cls, path: str) -> "VideoProcessor | None":
        proc = processor_config(cls, path, "video_preprocessor_config.json", "video_processor")
        if proc is None:
            return None
        if proc.resample not in _RESAMPLE:
            raise ValueError(f"{path}: video resample must be one of {sorted(_RESAMPLE)} (PIL's bilinear, bicubic)")
        return proc

    def __call__(self, frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """[F, H, W, 3] uint8 -> (patches [F, patches, 3 * patch_size**2] float32, positions [patches, 2])."""
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [F, C, H, W]
        h, w = x.shape[-2:]
        k, p = self.pooling_kernel_size, self.patch_size
        if self.do_resize:
            th, tw = fit_size(h, w, p, self.max_soft_tokens * k * k, k)
            if (th, tw) != (h, w):
                # torchvision's resize of a uint8 tensor: in float32, clamped and rounded back
                x = F.interpolate(x.float(), size=(th, tw), mode=_RESAMPLE[self.resample], align_corners=False,
                                  antialias=True).clamp_(0, 255).round_().to(torch.uint8)
                h, w = th, tw
        if self.do_rescale and self.do_normalize:  # fused as transformers fuses them, in float32
            mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
            std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
            x = (x.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
        elif self.do_normalize:
            x = (x.float() - torch.tensor(self.image_mean).view(-1, 1, 1)) / torch.tensor(self.image_std).view(-1, 1, 1)
        elif self.do_rescale:
            x = x * self.rescale_factor
        n, c = x.shape[:2]
        ph, pw = h // p, w // p
        patches = x.reshape(n, c, ph, p, pw, p).permute(0, 2, 4, 3, 5, 1).reshape(n, ph * pw, p * p * c)
        grid_y, grid_x = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
        return patches.contiguous(), torch.stack([grid_x, grid_y], -1).reshape(-1, 2)


@dataclass(frozen=True)
class VideoInput:
    """The video modality's processor: encoded bytes, a file path or decoded frames [F, H, W, 3]
    -> an item of one run a sampled frame, placed as Gemma4Processor.replace_video_token places them."""

    processor: VideoProcessor
    limits: VideoLimits
    limit: int  # videos one prompt may hold
    placeholder: int  # the video token, also each frame's soft token
    boi: int
    eoi: int
    encode_text: object  # str -> token ids, without special tokens (the timestamps)
    token_text: object  # token id -> its text
    modality = "video"

    @property
    def max_bytes(self) -> int:
        return self.limits.max_bytes

    def load(self, source, what: str = "video") -> MultiModalItem:
        if isinstance(source, MultiModalItem):
            return source
        if isinstance(source, np.ndarray):  # decoded frames; no rate known, so transformers' default of 24 fps
            if source.ndim != 4 or source.shape[-1] != 3 or source.dtype != np.uint8 or not len(source):
                raise VideoError(f"{what}: frames must be a uint8 array [frames, height, width, 3], got "
                                 f"{source.dtype}{list(source.shape)}")
            indices = sample_indices(len(source), self.processor.num_frames)
            return self.item(DecodedVideo(source[indices], 24.0, indices))
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if not os.path.isfile(path):
                raise VideoError(f"{what}: no such file {path!r}")
            if os.path.getsize(path) > self.limits.max_bytes:
                raise VideoError(f"{what} {path!r} is {os.path.getsize(path)} bytes, above the limit of "
                                 f"{self.limits.max_bytes} (--max-video-bytes)")
            with open(path, "rb") as f:
                source = f.read()
        if not isinstance(source, (bytes, bytearray, memoryview)):
            raise VideoError(f"{what} must be encoded bytes or a file path, not {type(source).__name__}")
        return self.item(decode_video(bytes(source), self.limits, self.processor.num_frames, what))

    def item(self, video: DecodedVideo) -> MultiModalItem:
        patches, positions = self.processor(video.frames)
        n = patches.shape[1] // self.processor.pooling_kernel_size**2
        boi, soft, eoi = map(self.token_text, (self.boi, self.placeholder, self.eoi))
        # Gemma4Processor.replace_video_token: "MM:SS <boi><video>...<eoi>" per frame, joined by spaces
        text = " ".join(f"{int(s // 60):02d}:{int(s % 60):02d} {boi}{soft * n}{eoi}" for s in video.timestamps)
        # For a prompt of token ids: each frame's text tokenized alone (a text prompt is expanded as
        # text, MultiModalItem.text, where the first timestamp tokenizes with what precedes it)
        tokens: list[int] = []
        runs = []
        for i, seconds in enumerate(video.timestamps):
            stamp = f"{int(seconds // 60):02d}:{int(seconds % 60):02d} "
            tokens += self.encode_text((" " if i else "") + stamp) + [self.boi]
            runs.append((len(tokens), len(tokens) + n))
            tokens += [self.placeholder] * n + [self.eoi]
        frames = tuple(patches.unbind(0))
        return MultiModalItem("video", frames, (positions,) * len(frames), tuple(tokens), tuple(runs),
                              pixel_digest(patches, positions), text)
