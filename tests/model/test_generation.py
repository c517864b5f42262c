"""Generation: token-for-token greedy parity with transformers' generate, and the sampler's contract."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import DEVICE, hf_generate_with_draft, load_hf

from blockdiff import LLM, SamplingParams

GREEDY = dict(t_min=1e-6, t_max=2e-6)


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def long_ckpt(checkpoints):
    return checkpoints(
        "gen-long", vocab_size=263, canvas_length=8, sliding_window=7, num_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], num_kv_heads=1,
        head_dim=8, global_head_dim=24, num_global_kv_heads=2, seed=7,
    )


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny) as llm:
        yield llm


def _hf_run(hf, prompt, draft, max_tokens, steps, **extra):
    """transformers' greedy generate; -> (tokens cut like ours, decoder passes)."""
    passes = [0]
    original = hf._denoising_step

    def counting(*a, **kw):
        passes[0] += 1
        return original(*a, **kw)

    hf._denoising_step = counting
    try:
        tokens = hf_generate_with_draft(
            hf, prompt, draft, max_new_tokens=max_tokens, max_denoising_steps=steps, **GREEDY, **extra
        )
    finally:
        del hf._denoising_step
    eos = set(hf.generation_config.eos_token_id or [])
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    tokens = tokens[: cut + 1] if cut is not None else tokens[:max_tokens]
    return tokens, passes[0]


@pytest.mark.parametrize("which,engine", [("tiny", {}), ("long", {}), ("long", {"max_prefill_tokens": 5, "max_num_seqs": 2})])
def test_greedy_parity_with_transformers_batched(which, engine, tiny, long_ckpt):
    """A batch of prompts of different lengths (one longer than the sliding window), >= 3 canvases
    each, against transformers run on each prompt alone: same tokens and same number of steps. Also
    with prompts prefilled 5 tokens a step across requests and a third request waiting for a slot."""
    path = tiny if which == "tiny" else long_ckpt
    vocab = 301 if which == "tiny" else 263
    hf = load_hf(path)
    lengths = [3, 11, 23]
    prompts = [_tokens(n, vocab, 100 + n) for n in lengths]
    drafts = [_tokens(32, vocab, 200 + n) for n in lengths]
    steps, max_tokens = 6, 29  # four canvases of 8, the last one cut
    with LLM(path, device=str(DEVICE), **engine) as llm:
        params = [SamplingParams(max_tokens=max_tokens, max_denoising_steps=steps, draft=d, **GREEDY) for d in drafts]
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, draft, out in zip(prompts, drafts, outs):
        want, passes = _hf_run(hf, prompt, draft, max_tokens, steps)
        assert out.token_ids == want
        assert out.metrics["denoising_steps"] == passes
        assert out.metrics["canvases"] >= 3 or out.finish_reason == "stop"


def test_early_convergence_matches_reference(tiny):
    """stability_threshold=0 makes a confident canvas stop after one step: at a tiny temperature
    every canvas is confident, so each canvas takes exactly one step, as in the reference."""
    hf = load_hf(tiny)
    prompt, draft = _tokens(5, 301, 1), _tokens(24, 301, 2)
    params = SamplingParams(max_tokens=24, max_denoising_steps=10, draft=draft, stability_threshold=0, ignore_eos=True, **GREEDY)
    with LLM(tiny, device=str(DEVICE)) as llm:
        out = llm.generate(prompt, params)[0]
    want, passes = _hf_run(hf, prompt, draft, 24, 10, stability_threshold=0)
    assert out.token_ids[: len(want)] == want
    assert out.metrics["denoising_steps"] == out.metrics["canvases"] == passes == 3
    # the same request without the shortcut runs longer
    with LLM(tiny) as llm:
        slow = llm.generate(prompt, SamplingParams(max_tokens=24, max_denoising_steps=10, draft=draft, ignore_eos=True, **GREEDY))[0]
    assert slow.metrics["denoising_steps"] > 3


def test_seed_reproducibility_and_batch_independence(llm):
    prompt = _tokens(6, 301, 3)
    params = SamplingParams(max_tokens=20, max_denoising_steps=8, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    assert alone.token_ids == again.token_ids
    others = [SamplingParams(max_tokens=n, max_denoising_steps=5 + n % 4, seed=n, ignore_eos=True) for n in (9, 17, 30)]
    batch = llm.generate([_tokens(4, 301, 5), prompt, _tokens(13, 301, 6), _tokens(2, 301, 7)], [others[0], params, others[1], others[2]], use_tqdm=False)
    assert batch[1].token_ids == alone.token_ids
    different = llm.generate(prompt, SamplingParams(max_tokens=20, max_denoising_steps=8, seed=4321, ignore_eos=True))[0]
    assert different.token_ids != alone.token_ids


def test_max_tokens_not_a_multiple_of_the_canvas(llm):
    out = llm.generate(_tokens(4, 301, 8), SamplingParams(max_tokens=13, max_denoising_steps=3, seed=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 13 and out.finish_reason == "length"
    assert out.metrics["canvases"] == 2 and out.metrics["committed_tokens"] == 13


def _greedy_tokens(llm, prompt, n=24):
    return llm.generate(prompt, SamplingParams(max_tokens=n, max_denoising_steps=4, draft=_tokens(n, 301, 9), ignore_eos=True, **GREEDY))[0].token_ids


def test_stop_token_ids_and_ignore_eos(llm):
    prompt = _tokens(5, 301, 10)
    free = _greedy_tokens(llm, prompt)
    stop_at = next(i for i, t in enumerate(free) if i >= 9 and free.index(t) == i)  # first occurrence past canvas 1
    params = SamplingParams(max_tokens=24, max_denoising_steps=4, draft=_tokens(24, 301, 9), stop_token_ids=[free[stop_at]], **GREEDY)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == free[: stop_at + 1] and out.finish_reason == "stop"
    # as in vLLM, the stop token is in token_ids but its text is not in the text
    tokenizer = llm.engine.tokenizer
    assert tokenizer.decode(free[stop_at : stop_at + 1]), "the stop token must have text for this check"
    assert out.text == tokenizer.decode(free[:stop_at])


def test_eos_from_generation_config(tiny, tmp_path):
    """The checkpoint's EOS ends generation (the EOS token kept, everything after dropped) unless ignored."""
    path = str(tmp_path / "eos")
    shutil.copytree(tiny, path)
    with LLM(path) as llm:
        free = _greedy_tokens(llm, _tokens(5, 301, 11))
    eos_pos = next(i for i, t in enumerate(free) if i >= 3 and free.index(t) == i)
    gen_file = os.path.join(path, "generation_config.json")
    with open(gen_file) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [free[eos_pos]]
    with open(gen_file, "w") as f:
        json.dump(gen, f)
    draft = _tokens(24, 301, 9)
    with LLM(path) as llm:
        out = llm.generate(_tokens(5, 301, 11), SamplingParams(max_tokens=24, max_denoising_steps=4, draft=draft, **GREEDY))[0]
        ignored = llm.generate(_tokens(5, 301, 11), SamplingParams(max_tokens=24, max_denoising_steps=4, draft=draft, ignore_eos=True, **GREEDY))[0]
    assert out.token_ids == free[: eos_pos + 1] and out.finish_reason == "stop"
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_stop_strings_cut_text_and_tokens(llm):
    prompt = "the quick brown"
    base = llm.generate(prompt, SamplingParams(max_tokens=32, max_denoising_steps=3, seed=5, ignore_eos=True))[0]
    text = base.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip() and text.find(stop) > 0, f"the seeded text {text!r} has no usable stop string"
    out = llm.generate(prompt, SamplingParams(max_tokens=32, max_denoising_steps=3, seed=5, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert base.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(base.token_ids)


def test_logprobs_and_text_prompts(llm):
    out = llm.generate("hello world", SamplingParams(max_tokens=10, max_denoising_steps=3, seed=1, logprobs=3, ignore_eos=True))[0]
    assert out.prompt == "hello world" and out.prompt_token_ids[0] == 2 and isinstance(out.text, str)
    completion = out.outputs[0]
    assert len(completion.token_logprobs) == 10
    for lp, tok in zip(completion.token_logprobs, out.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)  # the committed token is the argmax
    # vLLM's shape: per token {token id: Logprob}, the token itself (rank 1: the argmax) and its top 3
    for entry, lp, tok in zip(completion.logprobs, completion.token_logprobs, out.token_ids):
        assert entry[tok].logprob == lp.logprob and entry[tok].rank == 1 and len(entry) == 3
    assert completion.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.token_logprobs))


def test_chat_uses_the_template(llm):
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=8, max_denoising_steps=2, seed=0))[0]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_invalid_values_against_the_model(llm):
    with pytest.raises(ValueError, match="t_max"):
        SamplingParams(t_min=0.5, t_max=0.4)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2, 5000]])
    with pytest.raises(ValueError, match="draft"):
        llm.generate([[1, 2]], SamplingParams(draft=[9999]))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    # a batch whose second prompt fails leaves nothing behind of its first
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2], [1, 2, 5000]])
    assert not llm.engine.has_unfinished() and llm.engine.kv.full.used == 0 and not llm.engine.requests
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llm.engine.cfg.model, max_model_len=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llm.engine.cfg.model, max_model_len=-5)


def test_unseeded_requests_follow_the_engine_seed(tiny):
    params = SamplingParams(max_tokens=8, max_denoising_steps=4, ignore_eos=True)
    runs = []
    for seed in (3, 3, 4):
        with LLM(tiny, seed=seed) as llm:
            runs.append([o.token_ids for o in llm.generate([[2, 5, 9], [2, 7]], params, use_tqdm=False)])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_without_a_tokenizer_token_ids_work_and_text_features_are_refused(tiny, tmp_path):
    path = tmp_path / "no_tokenizer"
    shutil.copytree(tiny, path)
    os.remove(path / "tokenizer.json")
    with LLM(str(path)) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, max_denoising_steps=2, seed=0))[0]
        assert len(out.token_ids) >= 1 and out.text is None
        with pytest.raises(ValueError, match="stop strings"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, stop=["x"]))
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("hello")
