"""Video input against transformers: frames sampled, preprocessed and placed in the prompt as
Gemma4VideoProcessor and Gemma4Processor do it, and greedy generation equal to transformers'
generate; the bounds a video is checked against from its header, before any frame is decoded."""

from __future__ import annotations

import io
import json
import time
from fractions import Fraction
from types import SimpleNamespace

import av
import numpy as np
import pytest
import torch
from helpers import hf_generate_with_draft, load_hf

from blockdiff import LLM, SamplingParams
from blockdiff.model.tiny import IMAGE, VIDEO
from blockdiff.multimodal.video import VideoError, VideoLimits, decode_video

VISION_SPEC = dict(vocab_size=301, canvas_length=8, sliding_window=6, seed=3, vision=True)
# 42 x 60 is the size the tiny processor fits frames to (630 patches of 2 x 2 pixels, 70 soft
# tokens): transformers resizes with torchvision, which this environment lacks (test helper below).
HEIGHT, WIDTH = 42, 60
GREEDY = dict(t_min=1e-6, t_max=2e-6)


@pytest.fixture(scope="module")
def mm(checkpoints) -> str:
    return checkpoints("vision", **VISION_SPEC)


def encode_video(frames: np.ndarray, fps: int = 2) -> bytes:
    """[F, H, W, 3] uint8 -> an H.264 MP4 (PyAV)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def clip(seed: int, frames: int = 5) -> bytes:
    """Moving gradients plus noise, `frames` frames of HEIGHT x WIDTH at 2 fps."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    out = [np.stack([(x * 4 + 20 * t) % 256, (y * 6 + 30 * t) % 256, (x + y + seed * 7) % 256], -1)
           + rng.randint(-30, 30, (HEIGHT, WIDTH, 3)) for t in range(frames)]
    return encode_video(np.clip(np.stack(out), 0, 255).astype(np.uint8))


def claimed_video(width: int, height: int, frames: int, fps: int = 30) -> bytes:
    """A real MP4 of `frames` frames of width x height that is small to make and to send: one
    H.264 keyframe, then copies of one P-frame that changes nothing."""
    enc = av.CodecContext.create("libx264", "w")
    enc.width, enc.height, enc.pix_fmt, enc.time_base = width, height, "yuv420p", Fraction(1, fps)
    enc.options = {"preset": "ultrafast", "bf": "0"}
    black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), format="rgb24").reformat(format="yuv420p")
    packets = []
    for i in range(2):
        black.pts = i
        packets += enc.encode(black)
    packets += enc.encode(None)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.extradata = enc.extradata
        for i in range(frames):
            packet = av.Packet(bytes(packets[0] if i == 0 else packets[1]))
            packet.stream, packet.pts, packet.dts, packet.time_base = stream, i, i, Fraction(1, fps)
            packet.is_keyframe = i == 0
            out.mux(packet)
    return buf.getvalue()


def hf_video_processor(path: str):
    """transformers' Gemma4VideoProcessor of the checkpoint. Its module needs torchvision, which has no
    build for this environment's torch; the two torchvision functions these tests reach get stand-ins
    that do what torchvision's do here (normalize: (x - mean) / std per channel; grayscale_to_rgb:
    nothing, the frames are RGB). Resizing is not reached (the frames have the fitted size) and fails."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        import builtins

        def normalize(x, mean, std, inplace=False):
            return (x - torch.as_tensor(mean, dtype=x.dtype).view(-1, 1, 1)) / torch.as_tensor(std, dtype=x.dtype).view(-1, 1, 1)

        def resize(*args, **kwargs):
            raise AssertionError("frames of the fitted size are not resized")

        builtins.tvF = SimpleNamespace(InterpolationMode=object, grayscale_to_rgb=lambda v: v, normalize=normalize,
                                       resize=resize)
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    return Gemma4VideoProcessor.from_pretrained(path)


def hf_prompt(path: str, text: str, video_file: str):
    """transformers' processor output for a prompt with one video, and its expanded prompt ids."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    from transformers.video_utils import load_video

    # decoded whole by transformers' PyAV reader, then sampled by the processor
    frames, metadata = load_video(video_file, backend="pyav",
                                  sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames))
    out = hf_video_processor(path)([frames], video_metadata=[metadata], return_tensors="pt", return_metadata=True)
    tokens = SimpleNamespace(boi_token="<start_of_image>", eoi_token="<end_of_image>", video_token="<|video|>")
    expanded = text.replace("<|video|>", Gemma4Processor.replace_video_token(tokens, out, 0))
    tokenizer = AutoTokenizer.from_pretrained(path)
    # blockdiff puts the BOS that tokenizer_config.json's add_bos_token asks for before a text prompt;
    # transformers' fast tokenizer of this checkpoint puts none
    return out, [tokenizer.bos_token_id] + tokenizer(expanded)["input_ids"]


def _draft(seed: int) -> list[int]:
    return torch.randint(3, VISION_SPEC["vocab_size"], (24,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(draft: list[int]) -> SamplingParams:
    return SamplingParams(max_tokens=20, max_denoising_steps=4, draft=draft, **GREEDY)


PROMPT = "Describe <|video|> briefly."


@pytest.fixture(scope="module")
def case(mm, tmp_path_factory):
    """A clip, transformers' processor output and prompt ids for it, a draft, transformers' greedy tokens."""
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    path.write_bytes(clip(1))
    out, ids = hf_prompt(mm, PROMPT, str(path))
    draft = _draft(5)
    hf = load_hf(mm)
    # DiffusionGemma in transformers takes no videos; Gemma 4 encodes each frame with the image tower,
    # so transformers gets the frames as images: the video tokens as image tokens (their embeddings are
    # replaced by the frames' soft tokens), which mm_token_type_ids marks as vision.
    as_images = [IMAGE if t == VIDEO else t for t in ids]
    theirs = hf_generate_with_draft(hf, as_images, draft, max_new_tokens=20, max_denoising_steps=4,
                                    pixel_values=out["pixel_values_videos"], image_position_ids=out["video_position_ids"],
                                    mm_token_type_ids=(torch.tensor([as_images]) == IMAGE).long(), **GREEDY)
    eos = set(hf.generation_config.eos_token_id)
    theirs = theirs[: next((i + 1 for i, t in enumerate(theirs) if t in eos), 20)]
    return SimpleNamespace(path=path, out=out, ids=ids, draft=draft, theirs=theirs)


def test_frames_and_placeholders_equal_transformers(mm, case):
    out = case.out
    assert out["video_metadata"][0].frames_indices.tolist() == [0, 1, 3]  # 3 of 5 frames, as num_frames=3 samples
    with LLM(mm) as llm:
        [item] = llm.engine.inputs.mm.load({"video": [str(case.path)]})
        [got] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": case.path.read_bytes()}}, _greedy(case.draft),
                             use_tqdm=False)
    assert len(item.pixel_values) == 3
    for i, (pixels, positions) in enumerate(zip(item.pixel_values, item.position_ids)):
        assert torch.equal(pixels, out["pixel_values_videos"][i])  # bit for bit; 630 patches, no padding
        assert torch.equal(positions, out["video_position_ids"][i])
    assert got.prompt_token_ids == case.ids  # timestamps, <boi>, 70 video tokens, <eoi> per frame
    assert case.ids.count(VIDEO) == 3 * 70


@pytest.mark.parametrize("max_prefill_tokens", [2048, 16], ids=["whole-prompt", "chunked"])
def test_greedy_generation_with_a_video_equals_transformers(mm, case, max_prefill_tokens):
    with LLM(mm, max_prefill_tokens=max_prefill_tokens) as llm:
        [got] = llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": str(case.path)}}, _greedy(case.draft),
                             use_tqdm=False)
    assert got.prompt_token_ids == case.ids
    assert got.token_ids == case.theirs


def test_prefix_cache_keys_hold_the_video(mm, case, tmp_path):
    other = tmp_path / "other.mp4"
    other.write_bytes(clip(2))  # the same size and frame count: the same tokens, other pixels
    with LLM(mm, block_size=4) as llm:
        run = lambda video: llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": str(video)}},  # noqa: E731
                                         _greedy(case.draft), use_tqdm=False)[0]
        first, again, changed = run(case.path), run(case.path), run(other)
    frame = case.ids.index(VIDEO)  # the first frame's first soft token
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > len(case.ids) - 8
    assert first.token_ids == again.token_ids == case.theirs
    assert changed.num_cached_tokens <= frame - 1


def test_bad_videos_are_errors_naming_the_problem(mm, case):
    with LLM(mm) as llm:
        for bad, message in [
            ({"prompt": PROMPT, "multi_modal_data": {"video": [str(case.path)] * 2}},
             "2 videos in one prompt, above the limit of 1"),
            ({"prompt": PROMPT, "multi_modal_data": {"video": b"not a video"}}, "video 0 is not a video"),
            ({"prompt": "no placeholder", "multi_modal_data": {"video": str(case.path)}}, "0 video placeholders for 1 videos"),
            ({"prompt": PROMPT}, "1 video placeholders for 0 videos"),
        ]:
            with pytest.raises(ValueError, match=message):
                llm.generate(bad, _greedy(case.draft), use_tqdm=False)


def test_a_4k_video_of_1000_frames_is_refused_from_its_header():
    data = claimed_video(3840, 2160, 1000)
    assert len(data) < 100_000
    t0 = time.perf_counter()
    with pytest.raises(VideoError, match=r"\(1000 frames of 3840x2160\) is 8294400000 pixels to decode, above the limit "
                                         r"of 2147483648 \(--max-video-pixels\)"):
        decode_video(data, VideoLimits(64 * 2**20, 2**31, 40_000_000, 256 * 2**20), num_frames=32)
    with pytest.raises(VideoError, match=r"\(1000 frames of 3840x2160, 32 sampled\) decodes to 796262400 bytes, above the "
                                         r"limit of 268435456 \(--max-video-decoded-bytes\)"):
        decode_video(data, VideoLimits(64 * 2**20, 2**40, 40_000_000, 256 * 2**20), num_frames=32)
    assert time.perf_counter() - t0 < 1.0  # from the header: no frame decoded


def test_cli_generate_takes_videos(mm, case, capsys):
    from blockdiff.entrypoints.cli import main

    common = ["generate", "--model", mm, "--max-tokens", "8", "--max-denoising-steps", "2", "--seed-per-request", "3",
              "--json", "--video", str(case.path)]
    assert main([*common, "--chat", "What happens?"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["prompt_token_ids"].count(VIDEO) == 3 * 70 and len(out["outputs"][0]["token_ids"]) == 8


def test_decoded_frames_are_sampled_and_placed_as_transformers_does(mm, case):
    """Frames given as an array, without a rate: transformers' processor takes 24 fps."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    frames = np.stack([f.to_ndarray(format="rgb24") for f in av.open(str(case.path)).decode(video=0)])
    out = hf_video_processor(mm)([frames], return_tensors="pt", return_metadata=True)
    tokens = SimpleNamespace(boi_token="<start_of_image>", eoi_token="<end_of_image>", video_token="<|video|>")
    with LLM(mm) as llm:
        [item] = llm.engine.inputs.mm.load({"video": [frames]})
    assert item.text == Gemma4Processor.replace_video_token(tokens, out, 0)
    assert all(torch.equal(p, out["pixel_values_videos"][i]) for i, p in enumerate(item.pixel_values))


def test_a_video_that_needs_resizing_gets_the_processors_size(mm, tmp_path):
    """Frames of 20 x 31 are resized (torchvision's arithmetic, not checked against it here) to the
    size transformers computes, with its soft-token count."""
    hf_video_processor(mm)  # the module, importable
    from transformers.models.gemma4.video_processing_gemma4 import get_aspect_ratio_preserving_size

    frames = np.random.RandomState(0).randint(0, 256, (4, 20, 31, 3), dtype=np.uint8)
    th, tw = get_aspect_ratio_preserving_size(20, 31, patch_size=2, max_patches=630, pooling_kernel_size=3)
    with LLM(mm) as llm:
        [item] = llm.engine.inputs.mm.load({"video": [frames]})
    assert [p.shape for p in item.pixel_values] == [(th * tw // 4, 12)] * 3
    assert item.runs[0][1] - item.runs[0][0] == th * tw // 4 // 9


def test_images_and_videos_in_one_prompt(mm, case):
    from PIL import Image

    from blockdiff.model.tiny import BOI, EOI

    picture = Image.fromarray(np.random.RandomState(1).randint(0, 256, (30, 20, 3), dtype=np.uint8))
    prompt = {"prompt": "A <image_soft_token> then <|video|>.",
              "multi_modal_data": {"video": str(case.path), "image": picture}}
    with LLM(mm) as llm:
        [out] = llm.generate(prompt, SamplingParams(max_tokens=8), use_tqdm=False)
    ids = out.prompt_token_ids
    assert ids.count(BOI) == ids.count(EOI) == 4 and ids.count(VIDEO) == 3 * 70
    assert ids.index(IMAGE) < ids.index(VIDEO)  # each placeholder gets its own modality's item
