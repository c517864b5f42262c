"""The Triton attention backend (blockdiff/ops/triton_attention.py) against the reference backend,
under Triton's interpreter where there is no GPU (tests/conftest.py), on small shapes that hold
every case at once: in one launch a causal prompt chunk and a causal commit (each starting
mid-block) beside canvases that start mid-block, on sliding layers (window 8: the canvas sees
window - 1 cached positions plus its whole canvas) and full ones, grouped KV heads, V equal to K,
and block tables with holes (unordered block ids, given-back sliding blocks as -1). Each case is
also broken on purpose — a causal flag flipped, the canvas window ignored, a block id shifted, a
KV head mapped wrongly, a canvas's own keys left out — and the outputs must then differ."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

from blockdiff.arg_utils import add_engine_args, engine_config
from blockdiff.config import ATTENTION_BACKEND_CHOICES
from blockdiff.model.attention import CacheGeometry, Row, build_metadata, canvas_metadata
from blockdiff.model.attention_backends import AUTO, BACKENDS, choose_attention_backend
from blockdiff.model.interface import layer_kinds
from blockdiff.model.loader import load_model
from blockdiff.step import CacheConfig
from blockdiff.worker.kv_cache import allocate, geometry

BLOCK = 4
WINDOW = 8
NUM_BLOCKS = 64
SLOTS = 4
GEO = CacheGeometry(block_size=BLOCK, window_past=WINDOW - 1, window=WINDOW)


def _table(slot: int, sliding: bool, used: int) -> list[int]:
    """Unordered, non-contiguous block ids per slot; on sliding layers the blocks that no query's
    window reaches any more are given back (-1)."""
    ids = [(7 * (slot * 16 + i) + 3) % NUM_BLOCKS for i in range(16)]
    ids = ids[::-1] if slot % 2 else ids
    if sliding:
        ids = [-1 if (i + 1) * BLOCK <= used - WINDOW - 12 else b for i, b in enumerate(ids)]
    return ids


# A prompt chunk from position 5, a canvas at 22 (past the window, mid-block), a commit from 6, a
# canvas at 3 (a prefix shorter than the window). Encoder rows first, as the engine packs them.
ROWS = [Row(0, 5, 10, False), Row(2, 6, 8, False), Row(1, 22, 8, True), Row(3, 3, 8, True)]


def _tables(rows: list[Row]) -> dict[bool, torch.Tensor]:
    out = {}
    for sliding in (True, False):
        t = torch.full((SLOTS + 1, 16), -1, dtype=torch.long)
        for r in rows:
            t[r.slot] = torch.tensor(_table(r.slot, sliding, r.start + r.length))
        out[sliding] = t
    return out


def _inputs(heads: int, kv: int, dim: int, dtype: torch.dtype, tokens: int, v_is_k: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, k = rand(tokens, heads, dim), rand(tokens, kv, dim)
    v = k if v_is_k else rand(tokens, kv, dim)
    kc = rand(kv, NUM_BLOCKS * BLOCK, dim)
    vc = kc if v_is_k else rand(kv, NUM_BLOCKS * BLOCK, dim)
    return q, k, v, kc, vc


def _attend(backend: str, sliding: bool, inputs, rows=ROWS, tables=None, breaking=None) -> torch.Tensor:
    q, k, v, kc, vc = inputs
    meta = build_metadata(rows, replace(GEO, backend=backend), {sliding}, "cpu", tables or _tables(rows))
    kind = meta.kind(sliding)
    if breaking is not None:
        breaking(kind)
    cache = (kc.clone(), kc.clone()) if vc is kc else (kc.clone(), vc.clone())
    kind.write(k, v, cache)
    return kind.attend(q, k, v, cache).float()


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)


SHAPES = [(4, 2, 16), (4, 1, 32)]  # (heads, kv heads, head dim): groups of 2 and of 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gqa2-d16", "gqa4-d32"])
def test_mixed_step_matches_the_reference(dtype, sliding, shape):
    """Causal and bidirectional rows in one launch, through holed block tables."""
    tokens = build_metadata(ROWS, GEO, {sliding}, "cpu", _tables(ROWS)).num_tokens
    inputs = _inputs(*shape, dtype, tokens, v_is_k=False)
    want, got = _attend("reference", sliding, inputs), _attend("triton", sliding, inputs)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **_tolerance(dtype))
    else:
        # Both round the probabilities to bfloat16 before the product with V, at other points (the
        # reference after the global max, the kernel after each running max): each is held to the
        # float32 result, the kernel no further from it than the reference's error allows, plus half
        # a bfloat16 step of the largest output (the output's own rounding: where the CPU has no
        # bfloat16 products the reference's run in float32, ops/matmul.py `widens`, and its error
        # is smaller than a rounded product's).
        exact = _attend("reference", sliding, tuple(t.float() for t in inputs))
        torch.testing.assert_close(want, exact, **_tolerance(dtype))
        rounding = 2 ** -8 * exact.abs().max()
        assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + rounding + 1e-3


@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "full"])
def test_v_equal_to_k(sliding):
    """A layer without v_proj: one tensor is both K and V, in the cache and in the forward."""
    tokens = build_metadata(ROWS, GEO, {sliding}, "cpu", _tables(ROWS)).num_tokens
    inputs = _inputs(4, 2, 16, torch.float32, tokens, v_is_k=True)
    torch.testing.assert_close(_attend("triton", sliding, inputs), _attend("reference", sliding, inputs),
                               **_tolerance(torch.float32))


@pytest.mark.parametrize("causal", [True, False], ids=["causal-encoder", "bidirectional-encoder"])
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "full"])
def test_image_spans_and_an_encoder_that_is_not_causal(sliding, causal):
    """An image's tokens that attend both ways inside a causal chunk (widening their queries' ranges),
    and a checkpoint whose encoder is not causal (each query sees its chunk, and the window both ways)."""
    rows = [Row(0, 5, 12, False, bidirectional=((8, 13),)), Row(2, 6, 8, False), Row(1, 22, 8, True)]
    geo = replace(GEO, encoder_causal=causal)
    out = {}
    for backend in ("reference", "triton"):
        meta = build_metadata(rows, replace(geo, backend=backend), {sliding}, "cpu", _tables(rows))
        inputs = _inputs(4, 2, 16, torch.float32, meta.num_tokens, v_is_k=False)
        q, k, v, kc, vc = inputs
        cache = (kc.clone(), vc.clone())
        meta.kind(sliding).write(k, v, cache)
        out[backend] = meta.kind(sliding).attend(q, k, v, cache)
    torch.testing.assert_close(out["triton"], out["reference"], **_tolerance(torch.float32))


@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "full"])
def test_a_step_of_canvases_matches_the_reference(sliding):
    """The static step's metadata, built on the device: canvases mid-block, past and within the window."""
    starts = torch.tensor([22, 3, 13])
    tables = {s: t[torch.tensor([1, 3, 0])] for s, t in _tables([Row(1, 22, 8, True), Row(3, 3, 8, True),
                                                                  Row(0, 13, 8, True)]).items()}
    inputs = _inputs(4, 2, 16, torch.float32, 3 * 8, v_is_k=False)
    q, k, v, kc, vc = inputs
    out = {}
    for backend in ("reference", "triton"):
        kind = canvas_metadata(starts, {sliding: tables[sliding]}, 8, 32, replace(GEO, backend=backend)).kind(sliding)
        out[backend] = kind.attend(q, k, v, (kc, vc))
    torch.testing.assert_close(out["triton"], out["reference"], **_tolerance(torch.float32))


def _encoder_bidirectional(kind) -> None:
    """The causal flag flipped: the prompt chunk's queries see their whole chunk."""
    kind.bounds[:10, 1] = 15


def _canvas_window_ignored(kind) -> None:
    """The canvas at 22 sees every cached position, not the last window - 1."""
    kind.bounds[18:26, 0] = 0


def _block_shifted(kind) -> None:
    """One block id of the canvas at 22 moved to the next block."""
    kind.table[1, 4] += 1


def _own_keys_dropped(kind) -> None:
    """The canvases' own keys (their tiles' own count) left out."""
    kind.tiles[:, 4] = 0


def _kv_heads_swapped(kind) -> None:
    """Query heads read the other KV head: the cache's heads swapped in place."""
    original = kind.attend

    def swapped(q, k, v, cache):
        return original(q, k.flip(1), v.flip(1), (cache[0].flip(0), cache[1].flip(0)))

    kind.attend = swapped


BREAKS = {"causal-flag": _encoder_bidirectional, "canvas-window": _canvas_window_ignored, "block-id": _block_shifted,
          "own-keys": _own_keys_dropped, "gqa-heads": _kv_heads_swapped}
# (break, sliding layer): a full layer has no window to ignore.
CASES = [(name, sliding) for name in BREAKS for sliding in (True, False) if sliding or name != "canvas-window"]


@pytest.mark.parametrize("name, sliding", CASES, ids=[f"{n}-{'sliding' if s else 'full'}" for n, s in CASES])
def test_each_case_fails_when_broken(name, sliding):
    """The comparison above can fail: each case broken on purpose gives other outputs."""
    breaking = BREAKS[name]
    tokens = build_metadata(ROWS, GEO, {sliding}, "cpu", _tables(ROWS)).num_tokens
    inputs = _inputs(4, 2, 16, torch.float32, tokens, v_is_k=False)
    want = _attend("reference", sliding, inputs)
    torch.testing.assert_close(_attend("triton", sliding, inputs), want, **_tolerance(torch.float32))
    broken = _attend("triton", sliding, inputs, breaking=breaking)
    assert not torch.allclose(broken, want, atol=1e-3), f"{name} broken and the outputs did not change"


def test_the_row_ranges_hold_the_reference_masks():
    """The kernel's per-query ranges are the reference's rules, checked on their own: a causal query
    at p sees [p - 7, p + 1) on a sliding layer, a canvas at 22 sees [15, 22) and its canvas."""
    meta = build_metadata(ROWS, replace(GEO, backend="triton"), {True, False}, "cpu", _tables(ROWS))
    sliding, full = meta.sliding.bounds, meta.full.bounds
    p = torch.arange(5, 15)
    assert sliding[:10].tolist() == torch.stack(((p - WINDOW + 1).clamp(min=0), p + 1), 1).tolist()
    assert full[:10].tolist() == torch.stack((torch.zeros_like(p), p + 1), 1).tolist()
    assert sliding[18:26].tolist() == [[22 - (WINDOW - 1), 22]] * 8 and full[18:26].tolist() == [[0, 22]] * 8
    assert meta.sliding.tiles[:, 4].tolist() == [0, 0, 8, 8]  # only canvases carry own keys


def test_choose_attention_backend(monkeypatch):
    assert choose_attention_backend("cpu", torch.bfloat16) == "reference"
    assert choose_attention_backend("cpu", torch.float32, "auto") == "reference"
    assert choose_attention_backend("cpu", torch.float32, "reference") == "reference"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_attention_backend("cuda", torch.bfloat16) == "triton"
    assert choose_attention_backend("cuda:1", torch.bfloat16, "reference") == "reference"
    assert choose_attention_backend("cuda", torch.float64) == "reference"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert choose_attention_backend("cuda", torch.bfloat16) == "reference"
    with pytest.raises(ValueError, match="'flash'.*auto, reference, triton"):
        choose_attention_backend("cuda", torch.bfloat16, "flash")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_attention_backend("cpu", torch.float32, "triton") == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="'triton' runs on CUDA devices .* not on cpu"):
        choose_attention_backend("cpu", torch.float32, "triton")
    assert ATTENTION_BACKEND_CHOICES == (AUTO, *BACKENDS)  # the flag offers every backend


@torch.inference_mode()
def test_the_tiny_model_matches_the_reference(tiny):
    """The whole tiny model (sliding layers of head dim 16 over 2 KV heads, full ones of 32 over 1 with
    V from k_proj) with each backend: a prompt step of two rows, then a step of a prompt chunk beside a
    canvas, through unordered block tables; the logits agree."""
    model = load_model(tiny)
    cache = CacheConfig(num_slots=2, num_blocks=64, block_size=BLOCK, max_model_len=64)
    mine, other = tuple(range(40, 24, -1)), (3, 9, 1, 17, 60, 22, 5, 11)
    steps = [([Row(0, 0, 13, False, mine), Row(1, 0, 6, False, other)], list(range(3, 22))),
             ([Row(1, 6, 5, False, other), Row(0, 13, 8, True, mine)], list(range(30, 43)))]
    logits = {}
    for backend in ("reference", "triton"):
        geo, kv, out = replace(geometry(model, cache), backend=backend), allocate(model, cache, "cpu"), []
        for rows, ids in steps:
            meta = build_metadata(rows, geo, layer_kinds(model), "cpu")
            out.append(model(torch.tensor(ids + [0] * (meta.num_tokens - len(ids))), meta, kv, None)[: len(ids)])
        logits[backend] = torch.cat(out)
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-4, rtol=1e-4)


def test_the_attention_backend_flag(capsys):
    """--attention-backend takes the backends' names (as vLLM's does) into EngineConfig, once, at the edge."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--model", "demo"])).attention_backend == "auto"
    chosen = parser.parse_args(["--model", "demo", "--attention-backend", "triton"])
    assert engine_config(chosen).attention_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "demo", "--attention-backend", "flash"])
    assert "invalid choice: 'flash'" in capsys.readouterr().err


def test_the_kernel_compiles_whole():
    """torch.compile(fullgraph=True) sees the kernel as one op through its fake: a step of canvases'
    metadata and attention trace with no graph break and give the eager numbers."""
    starts = torch.tensor([22, 3])
    tables = {True: _tables([Row(1, 22, 8, True), Row(3, 3, 8, True)])[True][torch.tensor([1, 3])]}
    q, k, v, kc, vc = _inputs(4, 2, 16, torch.float32, 2 * 8, v_is_k=False)
    geo = replace(GEO, backend=choose_attention_backend("cpu", torch.float32, "triton"))  # as a worker does

    def step(starts, q, k, v, kc, vc):
        return canvas_metadata(starts, tables, 8, 32, geo).kind(True).attend(q, k, v, (kc, vc))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(starts, q, k, v, kc, vc), step(starts, q, k, v, kc, vc), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("sliding", [True, False], ids=["sliding", "full"])
def test_fp8_cache_matches_the_reference(dtype, sliding):
    """An FP8 (E4M3) cache with per-layer scales (--kv-cache-dtype fp8): the kernel loads the entries,
    widens them and applies the scales as the reference does; the step's own K/V are quantized on
    their way into the cache. Scales other than 1 so that a scale applied twice, or not at all, or
    K's applied to V, shows."""
    tokens = build_metadata(ROWS, GEO, {sliding}, "cpu", _tables(ROWS)).num_tokens
    q, k, v, kc, vc = _inputs(4, 2, 16, dtype, tokens, v_is_k=False, seed=3)
    scales = (torch.tensor(0.02), torch.tensor(0.05))
    cache = tuple((c.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn) for c, s in zip((kc, vc), scales))

    def attend(backend: str, scales) -> torch.Tensor:
        kind = build_metadata(ROWS, replace(GEO, backend=backend), {sliding}, "cpu", _tables(ROWS)).kind(sliding)
        c = tuple(t.clone() for t in cache)
        kind.write(k, v, c, scales)
        return kind.attend(q, k, v, c, scales).float()

    want, got = attend("reference", scales), attend("triton", scales)
    torch.testing.assert_close(got, want, **_tolerance(dtype))
    wrong = attend("reference", (scales[1], scales[0]))
    assert (wrong - want).abs().max() > 10 * (got - want).abs().max() + 1e-3
