"""The LM head of a bfloat16 model widens its output into the float32 logits HEAD_ROWS rows at a time:
the same bits as one product widened whole, with no bfloat16 output of every row beside the logits."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from blockdiff.model.diffusion_gemma import HEAD_ROWS
from blockdiff.model.loader import load_model
from blockdiff.ops.matmul import widens
from blockdiff.ops.softcap import softcap_


def test_bfloat16_logits_are_the_whole_product_widened_and_soft_capped(tiny):
    model = load_model(tiny, dtype=torch.bfloat16)
    rows = 2 * HEAD_ROWS + 24  # two full tiles and a short one
    hidden = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        want = model.embed.logits(hidden).float()
        if model.softcap:
            want = softcap_(want, model.softcap)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            got = model.logits(hidden)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # What the head allocated: the float32 logits, and a tile's bfloat16 product at a time (its
    # float32 product first, where bfloat16 products run in float32: ops/matmul.py `widens`).
    allocations = sorted(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    vocab = model.shard.local_rows
    tile = HEAD_ROWS * vocab * (4 if widens(hidden) else 2)
    assert allocations[-1] == rows * vocab * 4
    assert max(allocations[:-1]) <= tile, allocations  # not the whole product's rows * vocab * 2 (or 4)
