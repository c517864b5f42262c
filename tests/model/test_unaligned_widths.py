"""Widths that torch's grouped products cannot take as they are: each expert's per-rank intermediate
width and the hidden size are zero-padded at load time (blockdiff/ops/kernels.py, model/moe.py), and
greedy generation stays token for token transformers' at one, two and three ranks.

moe_intermediate_size 20 at two ranks is 10 float32 columns (40 bytes) per rank, which
`torch._grouped_mm` refuses ("strides should be multiple of 16 bytes"); 20 at three ranks does not
divide (7, 7 and 6 columns); 36 at two ranks is 18 columns; hidden 50 is 200 bytes a row."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from helpers import hf_generate_with_draft, load_hf, rel_err

from blockdiff import LLM, SamplingParams
from blockdiff.model.registry import load_config
from blockdiff.model.loader import load_model
from blockdiff.model.moe import Experts
from blockdiff.model.saver import checkpoint_tensors
from blockdiff.parallel.group import TPGroup

BIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "diffusiongemma-26b-a4b.json")
GREEDY = dict(t_min=1e-6, t_max=2e-6)
MAX_TOKENS, STEPS = 16, 4
# Odd vocabulary, GQA, two head dims, the prompt of 11 tokens longer than the window of 7.
BASE = dict(vocab_size=263, hidden_size=48, intermediate_size=96, num_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_heads=12, num_kv_heads=6,
            head_dim=8, global_head_dim=16, num_global_kv_heads=1, num_experts=4, top_k_experts=2,
            sliding_window=7, canvas_length=8, seed=5)
WIDTHS = {"moe20": dict(moe_intermediate_size=20), "moe24": dict(moe_intermediate_size=24),
          "moe36": dict(moe_intermediate_size=36), "hidden50": dict(moe_intermediate_size=20, hidden_size=50)}
CASES = [(w, tp) for w in WIDTHS for tp in (1, 2, 3)]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_tokens(3, 1), _tokens(11, 2)]
DRAFTS = [_tokens(MAX_TOKENS, 3), _tokens(MAX_TOKENS, 4)]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """name -> (checkpoint, transformers' greedy tokens per prompt, cut after the first EOS)."""
    made = {}

    def get(name: str):
        if name not in made:
            path = checkpoints(f"unaligned-{name}", **{**BASE, **WIDTHS[name]})
            # transformers' own grouped experts refuse hidden 50 too: its per-expert loop is the oracle
            hf = load_hf(path, experts_implementation="eager")
            eos = set(hf.generation_config.eos_token_id)
            want = []
            for prompt, draft in zip(PROMPTS, DRAFTS):
                theirs = hf_generate_with_draft(hf, prompt, draft, max_new_tokens=MAX_TOKENS, max_denoising_steps=STEPS, **GREEDY)
                want.append(theirs[: next((i + 1 for i, t in enumerate(theirs) if t in eos), MAX_TOKENS)])
            made[name] = path, want
        return made[name]

    return get


@pytest.mark.usefixtures("single_threaded_workers")
@pytest.mark.parametrize("name,tp", CASES, ids=[f"{w}-tp{tp}" for w, tp in CASES])
def test_greedy_generation_equals_transformers(reference, name, tp):
    path, want = reference(name)
    params = [SamplingParams(max_tokens=MAX_TOKENS, max_denoising_steps=STEPS, draft=d, **GREEDY) for d in DRAFTS]
    with LLM(path, tensor_parallel_size=tp) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("inter,ranks", [(20, 1), (20, 2), (20, 3), (24, 2), (36, 2), (704, 8)])
def test_every_rank_runs_grouped_products_whose_sum_is_one_rank(inter, ranks, dtype):
    """Each rank's experts hold ceil(I / ranks) columns (the last rank fewer where I does not
    divide), padded to 16 bytes, and run the grouped products; the ranks' outputs add up to one
    rank's. Where the unpadded width misses 16 bytes, the grouped op itself refuses it."""
    config = replace(load_config(BIG).arch, hidden_size=48, num_experts=4, top_k_experts=2,
                     moe_intermediate_size=inter)
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(4, 2 * inter, 48, generator=g).to(dtype)
    down = torch.randn(4, 48, inter, generator=g).to(dtype)
    x = torch.randn(24, 48, generator=g).to(dtype)
    weights = torch.rand(24, 2, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])

    def experts(rank: int, size: int) -> Experts:
        e = Experts(config, TPGroup(rank, size), dtype)
        e.reduce = False  # no group behind it: the sum over ranks is taken here
        e.load_gate_up(e.gate_up, gate_up, "gate_up")
        e.load_down(e.down, down, "down")
        return e

    with torch.inference_mode():
        want = experts(0, 1)(x, weights, index)
        parts = [experts(r, ranks) for r in range(ranks)]
        assert all(p.grouped(x) and p.local * dtype.itemsize % 16 == 0 for p in parts)
        assert sum(p.owned for p in parts) == inter
        got = sum(p(x, weights, index).float() for p in parts)
    # bfloat16: each rank's output is rounded before the sum, one rank's once
    assert rel_err(got, want) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    width = -(-inter // ranks)
    if width * dtype.itemsize % 16:
        with pytest.raises(RuntimeError, match="16 bytes"):
            torch._grouped_mm(x[:, :width].contiguous(), down[:, :, :width].transpose(1, 2),
                              offs=torch.tensor([8, 16, 24, 24], dtype=torch.int32))


def test_padding_is_not_saved_and_dummy_weights_keep_it_zero(checkpoints, tmp_path):
    """The saver writes the checkpoint's shapes, not the padded ones; the dummy loader's random
    fill leaves the padding zero."""
    path = checkpoints("unaligned-hidden50", **{**BASE, **WIDTHS["hidden50"]})
    model = load_model(path)
    experts = model.layers[0].experts
    assert (experts.local, experts.hidden_in) == (20, 52)
    tensors = checkpoint_tensors(model)
    assert tuple(tensors["model.decoder.layers.0.experts.gate_up_proj"].shape) == (4, 40, 50)
    assert tuple(tensors["model.decoder.layers.0.experts.down_proj"].shape) == (4, 50, 20)
    dummy = load_model(path, load_format="dummy")
    e = dummy.layers[0].experts
    assert e.gate_up[..., 50:].abs().sum() == 0 and e.down[:, 50:].abs().sum() == 0
    assert e.gate_up[..., :50].abs().sum() > 0
