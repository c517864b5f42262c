"""Test helpers: the transformers oracle and a one-sequence harness that drives our model
through its real cache and metadata."""

from __future__ import annotations

import os

import torch

from blockdiff.step import CacheConfig
from blockdiff.worker.kv_cache import allocate, geometry
from blockdiff.model.attention import Row, build_metadata
from blockdiff.model.interface import layer_kinds


# The device the parity and generation tests run our model and transformers on
# (scripts/device_check.sh sets cuda); the engine's own default, "auto", picks the same.
DEVICE = torch.device(os.environ.get("BLOCKDIFF_TEST_DEVICE", "cpu"))


def load_hf(path: str, dtype=torch.float32, **kwargs):
    from transformers import DiffusionGemmaForBlockDiffusion

    return DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype, **kwargs).to(DEVICE).eval()


def hf_generate_with_draft(hf, prompt: list[int], draft: list[int], **kwargs) -> list[int]:
    """transformers' generate with canvas k seeded from draft[k*CL:(k+1)*CL] (noise past the draft)."""
    cl = hf.config.canvas_length
    original = hf._prepare_denoiser_inputs
    canvas = [0]

    def seeded(*args, **kw):
        chunk = draft[canvas[0] * cl : (canvas[0] + 1) * cl]
        if len(chunk) == cl:
            kw["model_kwargs"]["decoder_input_ids"] = torch.tensor([chunk], device=hf.device)
        canvas[0] += 1
        return original(*args, **kw)

    hf._prepare_denoiser_inputs = seeded
    try:
        out = hf.generate(torch.tensor([prompt], device=hf.device), **kwargs)
    finally:
        del hf._prepare_denoiser_inputs
    return out.sequences[0, len(prompt) :].tolist()


class Harness:
    """One sequence through our model: encode() appends to the cache, decode() reads it."""

    def __init__(self, model, max_len: int = 256, block_size: int = 8):
        self.model = model
        cfg = CacheConfig(num_slots=1, num_blocks=-(-max_len // block_size), block_size=block_size, max_model_len=max_len)
        self.kv = allocate(model, cfg, DEVICE)
        self.geo = geometry(model, cfg)
        self.blocks = tuple(range(cfg.num_blocks))
        self.length = 0

    @torch.no_grad()
    def encode(self, ids: list[int], images=None, bidirectional: tuple[tuple[int, int], ...] = ()) -> None:
        """`images`: blockdiff.model.vision.ImageInputs for the placeholders among `ids`;
        `bidirectional`: their [start, end) position spans, as the engine gives them."""
        row = Row(0, self.length, len(ids), False, self.blocks, bidirectional=bidirectional)
        meta = build_metadata([row], self.geo, layer_kinds(self.model), DEVICE)
        self.model(_padded(ids, meta), meta, self.kv, images=images)
        self.length += len(ids)

    @torch.no_grad()
    def decode(self, canvas: list[int], soft: torch.Tensor | None = None) -> torch.Tensor:
        meta = build_metadata([Row(0, self.length, len(canvas), True, self.blocks)], self.geo, layer_kinds(self.model), DEVICE)
        return self.model(_padded(canvas, meta), meta, self.kv, soft)


def _padded(ids: list[int], meta) -> torch.Tensor:
    return torch.tensor(ids + [0] * (meta.num_tokens - len(ids)), device=DEVICE)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
