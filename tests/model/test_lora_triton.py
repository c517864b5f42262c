"""The segmented LoRA product's Triton kernels (blockdiff/model/lora_triton.py) against the plain torch
product of model/lora.py, under Triton's interpreter where there is no GPU (tests/conftest.py): a
fused layer of three parts of different widths (q/k/v), adapters of different ranks in a pool of
three slots, tokens of every slot and of none, both modes."""

from __future__ import annotations

import torch

from blockdiff.model.lora_layers import DECODER, ENCODER, LoRABatch, LoRALinear
from blockdiff.model.lora_triton import lora_expand, lora_shrink


def _pool(seed: int) -> LoRALinear:
    g = torch.Generator().manual_seed(seed)
    parts = [(48, 48, 0), (16, 16, 0), (16, 16, 0)]
    pool = LoRALinear(parts, 40, 40, 0, slots=3, rank=8, dtype=torch.float32)
    for slot, r in ((0, 8), (1, 3), (2, 5)):
        for mode in (ENCODER, DECODER):
            for p, (rows, _, _) in enumerate(parts):
                pool.put(slot, mode, p, torch.randn(r, 40, generator=g), torch.randn(rows, r, generator=g), 0.5 + slot,
                         f"slot{slot}")
    return pool


def _triton(pool: LoRALinear, x: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    part = torch.cat([torch.full((p[1],), i, dtype=torch.int32) for i, p in enumerate(pool.parts)])
    ne = batch.num_encoder_tokens
    out = []
    for mode, sl in ((ENCODER, slice(0, ne)), (DECODER, slice(ne, x.shape[0]))):
        xs, idx = x[sl], batch.index[sl].contiguous()
        s = lora_shrink(xs, pool.a[mode], idx, len(pool.parts), pool.slots, pool.rank)
        out.append(lora_expand(torch.zeros(xs.shape[0], pool.b.shape[1]), s, pool.b[mode], idx, part, pool.rank))
    return torch.cat(out)


def test_triton_segmented_product_matches_torch():
    pool = _pool(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 40, generator=g)
    index = torch.tensor([0, 1, -1, 2, 2, 0, -1, 1, 0, 2, -1, 1, 0])
    batch = LoRABatch(index, 5)
    want = pool(x, batch)
    got = _triton(pool, x, batch)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[index == -1], torch.zeros_like(got[index == -1]))  # no adapter: nothing added
    # a token's slot matters: the kernel reads each token's own adapter
    wrong = _triton(pool, x, LoRABatch(index.roll(1), 5))
    assert not torch.allclose(wrong, want, atol=1e-2)
