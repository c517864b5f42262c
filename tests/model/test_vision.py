"""The vision path against transformers: the encoder's soft tokens, and logits of prompts that hold
images (their tokens bidirectional in the encoder), on one rank and on two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import Harness, Oracle, load_hf, rel_err
from PIL import Image
from rank_checks import image_prompt_logits
from transformers import AutoImageProcessor

from blockdiff.model.loader import load_model
from blockdiff.model.tiny import BOI, EOI, IMAGE
from blockdiff.step import ImageInputs
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext, RankProcesses

FP32_TOL = 1e-4  # the text model's (test_parity.py)
# Odd vocabulary, GQA, a window of 6 that image tokens outrun (the image's own tokens still see
# each other), sliding and full layers of different head dims.
VISION_SPEC = dict(vocab_size=301, canvas_length=8, sliding_window=6, seed=3, vision=True)


@pytest.fixture(scope="module")
def mm(checkpoints) -> str:
    return checkpoints("vision", **VISION_SPEC)


def picture(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    # smooth gradients plus noise: resizing has structure to keep
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) % 256], -1)
    return Image.fromarray(np.clip(base + rng.randint(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8))


def hf_pixels(path: str, images: list[Image.Image]):
    """transformers' processor output, and per image its unpadded patches and positions."""
    out = AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
    k2 = AutoImageProcessor.from_pretrained(path).pooling_kernel_size ** 2
    per_image = [
        (out["pixel_values"][i, : n * k2], out["image_position_ids"][i, : n * k2])
        for i, n in enumerate(out["num_soft_tokens_per_image"].tolist())
    ]
    return out, per_image


def image_prompt(counts: list[int], seed: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Text, then per image <boi> soft tokens <eoi> and more text; -> ids and the images' spans."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(EOI + 1, VISION_SPEC["vocab_size"], (n,), generator=g).tolist()  # noqa: E731
    ids, spans = [2] + text(3), []
    for n in counts:
        ids.append(BOI)
        spans.append((len(ids), len(ids) + n))
        ids += [IMAGE] * n + [EOI] + text(2)
    return ids, spans


def image_inputs(per_image, ids: list[int]) -> ImageInputs:
    index = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE])
    return ImageInputs([p for p, _ in per_image], [q for _, q in per_image], torch.arange(len(index)), index)


@pytest.mark.parametrize("size", [(40, 30), (24, 60), (7, 90), (50, 50)])
def test_soft_tokens_equal_transformers(mm, size):
    ours, hf = load_model(mm), load_hf(mm)
    out, per_image = hf_pixels(mm, [picture(*size, seed=sum(size))])
    with torch.no_grad():
        want = hf.model.encoder.get_image_features(out["pixel_values"], out["image_position_ids"]).pooler_output
        got = ours.vision(*per_image[0])
    assert got.shape == want.shape == (out["num_soft_tokens_per_image"][0], ours.config.hidden_size)
    assert rel_err(got, want) <= FP32_TOL


def _canvas(seed: int) -> list[int]:
    return torch.randint(3, VISION_SPEC["vocab_size"], (8,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_of_a_prompt_with_two_images_equal_transformers(mm):
    images = [picture(30, 20, 1), picture(12, 40, 2)]
    out, per_image = hf_pixels(mm, images)
    ids, spans = image_prompt(out["num_soft_tokens_per_image"].tolist(), seed=4)
    first, second = _canvas(5), _canvas(6)
    ours, ref = Harness(load_model(mm)), Oracle(load_hf(mm))
    ours.encode(ids, image_inputs(per_image, ids), tuple(spans))
    ref.encode(ids, out, IMAGE)
    assert rel_err(ours.decode(first), ref.decode(first)) <= FP32_TOL
    # a committed canvas is causal (transformers drops mm_token_type_ids after the prompt)
    ours.encode(first)
    ref.encode(first)
    want = ref.decode(second)
    assert rel_err(ours.decode(second), want) <= FP32_TOL

    # Both the image and the bidirectional mask must matter, or this test would test neither.
    causal = Harness(load_model(mm))
    causal.encode(ids, image_inputs(per_image, ids))
    causal.encode(first)
    assert rel_err(causal.decode(second), want) > 10 * FP32_TOL
    blind = Harness(load_model(mm))
    blind.encode(ids, bidirectional=tuple(spans))
    blind.encode(first)
    assert rel_err(blind.decode(second), want) > 10 * FP32_TOL


def test_tensor_parallel_logits_with_images_equal_one_rank(mm, single_threaded_workers):
    images = [picture(30, 20, 1), picture(12, 40, 2)]
    out, per_image = hf_pixels(mm, images)
    ids, spans = image_prompt(out["num_soft_tokens_per_image"].tolist(), seed=7)
    args = (mm, ids, per_image, spans, _canvas(8))
    single = image_prompt_logits(RankContext(0, 1, torch.device("cpu"), TPGroup()), *args)
    with RankProcesses(2, "cpu") as two:
        split = two.run(image_prompt_logits, *args, gather=True)
    for got in split:
        assert rel_err(got, single) <= FP32_TOL


def test_make_tiny_model_vision_is_a_multimodal_checkpoint_transformers_loads(tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    from blockdiff.entrypoints.cli import main

    path = str(tmp_path / "mm")
    assert main(["make-tiny-model", path, "--vision", "--vocab-size", "211", "--num-layers", "2"]) == 0
    _, info = DiffusionGemmaForBlockDiffusion.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    processor = AutoImageProcessor.from_pretrained(path)
    assert (processor.patch_size, processor.max_soft_tokens) == (2, 70)
    model = load_model(path)
    assert model.vision is not None and model.config.vision.bidirectional
    assert model.vision.layers[0].self_attn.q_proj.bounds.isfinite().all()  # the clamp bounds were loaded


def test_a_checkpoint_without_vision_tensors_loads_text_only(tmp_path, mm):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "text-only"
    shutil.copytree(mm, path)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "vision" not in k}, str(path / "model.safetensors"))
    model = load_model(str(path))
    assert model.vision is None and load_model(mm).vision is not None


# ---- generation through the engine -----------------------------------------------------------
GREEDY = dict(t_min=1e-6, t_max=2e-6)


def _greedy(draft: list[int], **extra):
    from blockdiff import SamplingParams

    return SamplingParams(max_tokens=20, max_denoising_steps=4, draft=draft, **GREEDY, **extra)


def _hf_generate(hf, path: str, images, ids: list[int], draft: list[int]) -> list[int]:
    from helpers import hf_generate_with_draft

    out = AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
    mm_types = (torch.tensor([ids]) == IMAGE).long()
    theirs = hf_generate_with_draft(hf, ids, draft, max_new_tokens=20, max_denoising_steps=4, pixel_values=out["pixel_values"],
                                    image_position_ids=out["image_position_ids"], mm_token_type_ids=mm_types, **GREEDY)
    eos = set(hf.generation_config.eos_token_id)
    return theirs[: next((i + 1 for i, t in enumerate(theirs) if t in eos), 20)]


def _unexpanded(ids: list[int]) -> list[int]:
    """The prompt as the user writes it: one image token per image."""
    out = []
    for t in ids:
        if t in (BOI, EOI) or (t == IMAGE and out and out[-1] == IMAGE):
            continue
        out.append(t)
    return out


@pytest.fixture(scope="module")
def generation_cases(mm):
    """(images, expanded prompt, draft, transformers' greedy tokens) with one image and with two."""
    hf = load_hf(mm)
    cases = []
    for k, images in enumerate([[picture(33, 21, 11)], [picture(18, 45, 12), picture(40, 40, 13)]]):
        counts = AutoImageProcessor.from_pretrained(mm)(images)["num_soft_tokens_per_image"]
        ids, _ = image_prompt(list(counts), seed=20 + k)
        draft = _canvas(30 + k) + _canvas(40 + k) + _canvas(50 + k)
        cases.append((images, ids, draft, _hf_generate(hf, mm, images, ids, draft)))
    return cases


@pytest.mark.parametrize("max_prefill_tokens", [2048, 16], ids=["whole-prompt", "chunked"])
def test_greedy_generation_with_images_equals_transformers(mm, generation_cases, max_prefill_tokens):
    from blockdiff import LLM

    prompts = [{"prompt_token_ids": _unexpanded(ids), "multi_modal_data": {"image": images}} for images, ids, _, _ in generation_cases]
    # a text prompt batched with the image prompts
    text = [2] + _canvas(60)
    with LLM(mm, max_prefill_tokens=max_prefill_tokens) as llm:
        outs = llm.generate(prompts + [text], [_greedy(d) for _, _, d, _ in generation_cases] + [_greedy(_canvas(61), seed=7)],
                            use_tqdm=False)
        alone = llm.generate(text, _greedy(_canvas(61), seed=7), use_tqdm=False)[0]
    for out, (_, ids, _, theirs) in zip(outs, generation_cases):
        assert out.prompt_token_ids == ids  # placeholders expanded as the processor does
        assert out.token_ids == theirs
    assert outs[-1].token_ids == alone.token_ids


def test_prefix_cache_shares_blocks_only_for_the_same_image(mm, generation_cases):
    from blockdiff import LLM

    images, ids, draft, theirs = generation_cases[1]
    prompt = _unexpanded(ids)
    other = [images[0], picture(40, 40, 99)]  # same sizes, so the same tokens, but another second image
    with LLM(mm, block_size=4) as llm:
        first = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, _greedy(draft), use_tqdm=False)[0]
        again = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, _greedy(draft), use_tqdm=False)[0]
        changed = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": other}}, _greedy(draft), use_tqdm=False)[0]
        # bad image input to the offline API: a ValueError naming the problem
        for bad, message in [
            ({"prompt_token_ids": [2] + [IMAGE] * 5, "multi_modal_data": {"image": [images[0]] * 5}}, "5 images in one prompt, above the limit of 4"),
            ({"prompt_token_ids": [2, IMAGE], "multi_modal_data": {"image": images}}, "1 image placeholders for 2 images"),
            ({"prompt_token_ids": [2, IMAGE], "multi_modal_data": {"image": [b"\x89PNG\r\n\x1a\n"]}}, "image 0 is not an image in a known format"),
            ({"prompt_token_ids": [2, IMAGE], "multi_modal_data": {"audio": [b""]}}, "multi_modal_data takes 'image' and 'video'"),
        ]:
            with pytest.raises(ValueError, match=message):
                llm.generate(bad, _greedy(draft), use_tqdm=False)
    assert first.token_ids == again.token_ids == theirs
    second_image = ids.index(IMAGE, ids.index(EOI))  # the first soft token of the second image
    # the same images: the hit covers the second image too; another second image: the hit stops
    # before it, at a block boundary outside every image
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= ids.index(EOI, second_image)
    assert 0 < changed.num_cached_tokens <= second_image - 1 and changed.num_cached_tokens % 4 == 0


@pytest.mark.slow  # ~35 s: two ranks, model load and generation (the executor carrying images to every rank)
def test_tensor_parallel_generation_with_images_equals_transformers(mm, generation_cases, single_threaded_workers):
    from blockdiff import LLM

    images, ids, draft, theirs = generation_cases[1]
    with LLM(mm, tensor_parallel_size=2) as llm:
        out = llm.generate({"prompt_token_ids": _unexpanded(ids), "multi_modal_data": {"image": images}}, _greedy(draft),
                           use_tqdm=False)[0]
    assert out.token_ids == theirs  # == one rank's (test_greedy_generation_with_images_equals_transformers)


def test_cli_generate_takes_images(mm, tmp_path, capsys):
    import json

    from blockdiff.entrypoints.cli import main

    path = tmp_path / "picture.png"
    picture(30, 20, 1).save(path)
    common = ["generate", "--model", mm, "--max-tokens", "8", "--max-denoising-steps", "2", "--seed-per-request", "3",
              "--json", "--image", str(path)]
    assert main([*common, "--chat", "What is this?"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    n = hf_pixels(mm, [picture(30, 20, 1)])[0]["num_soft_tokens_per_image"][0]
    assert out["prompt_token_ids"].count(IMAGE) == n and len(out["outputs"][0]["token_ids"]) == 8
    assert main([*common, "--image", str(tmp_path / "missing.png"), "--chat", "and this?"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: image 1: no such file {str(tmp_path / 'missing.png')!r}"
