"""Attention reads the paged cache in position order with a fixed reduction structure
(model/attention.py): a query's result depends on its own keys only. So the K/V a sequence leaves
in the cache are the same bits however it was cut into chunks (a prompt in one chunk, in prompt
chunks and one commit row per canvas, or recomputed in one chunk after a preemption), whichever
rows shared its steps, and a canvas's logits are the same alone, in a batch of canvases with other
contexts, and in the static step's padded shapes."""

from __future__ import annotations

import pytest
import torch

from blockdiff.model.attention import QUERY_TILE, Row, build_metadata, canvas_metadata
from blockdiff.model.interface import layer_kinds
from blockdiff.model.loader import load_model
from blockdiff.step import CacheConfig
from blockdiff.worker.kv_cache import allocate, geometry

BLOCK = 4
CACHE = CacheConfig(num_slots=4, num_blocks=4 * 200, block_size=BLOCK, max_model_len=800)


@pytest.fixture(scope="module")
def model(tiny):
    return load_model(tiny)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 301, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _blocks(slot: int) -> tuple[int, ...]:
    per = CACHE.num_blocks // CACHE.num_slots
    return tuple(range(slot * per, (slot + 1) * per))


@torch.inference_mode()
def _forward(model, kv, rows: list[Row], ids: list[int], soft=None) -> torch.Tensor:
    geo = geometry(model, CACHE)
    meta = build_metadata(rows, geo, layer_kinds(model), "cpu")
    return model(torch.tensor(ids + [0] * (meta.num_tokens - len(ids))), meta, kv, soft)


def _prefill(model, tokens: list[int], cuts: list[int], companion: list[int] | None = None):
    """The cache after `tokens` went through the encoder cut at `cuts` (one step per piece), each
    step beside a chunk of `companion` (another sequence, slot 1) when given; -> [(K, V)] of slot 0's
    positions per layer."""
    kv = allocate(model, CACHE, "cpu")
    bounds = [0, *cuts, len(tokens)]
    done = 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        rows, ids = [Row(0, a, b - a, False, _blocks(0))], tokens[a:b]
        if companion is not None:
            n = min(5, len(companion) - done)
            if n > 0:
                rows.append(Row(1, done, n, False, _blocks(1)))
                ids = ids + companion[done : done + n]
                done += n
        _forward(model, kv, rows, ids)
    n = len(tokens)
    return [(k[:, :n].clone(), v[:, :n].clone()) for k, v in kv]  # slot 0's blocks come first


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for (kx, vx), (ky, vy) in zip(a, b) for x, y in ((kx, ky), (vx, vy)))


def test_the_cache_holds_the_same_bits_however_a_sequence_was_chunked(model):
    """One chunk, prompt chunks then one row per canvas of 8, single tokens, and chunks beside
    another sequence's: the same K/V at every layer, sliding and full."""
    tokens = _tokens(61, 0)
    whole = _prefill(model, tokens, [])
    for cuts in ([13, 21, 29, 37, 45, 53], list(range(1, 61)), [7, 40]):
        assert _same(_prefill(model, tokens, cuts), whole), cuts
    assert _same(_prefill(model, tokens, [13, 21, 29], companion=_tokens(40, 1)), whole)


def test_a_chunk_longer_than_a_query_tile_caches_what_short_chunks_do(model):
    tokens = _tokens(QUERY_TILE + 90, 2)
    assert _same(_prefill(model, tokens, []), _prefill(model, tokens, list(range(100, QUERY_TILE + 90, 100))))


def _canvas_logits(model, start: int, others: list[int], static: bool) -> torch.Tensor:
    """The logits of a canvas over a prefix of `start` tokens (slot 0), denoised beside canvases
    over prefixes of `others` tokens (slots 1...), through the eager metadata or the static step's."""
    kv = allocate(model, CACHE, "cpu")
    cl = model.config.canvas_length
    starts = [start, *others]
    for slot, n in enumerate(starts):
        _forward(model, kv, [Row(slot, 0, n, False, _blocks(slot))], _tokens(n, 10 + slot))
    canvases = [_tokens(cl, 20)] + [_tokens(cl, 21 + i) for i in range(len(others))]
    ids = torch.tensor(sum(canvases, []))
    with torch.inference_mode():
        if static:
            tables = {s: torch.tensor([_blocks(slot) for slot in range(len(starts))]) for s in layer_kinds(model)}
            context = 4 * max(starts)  # padded well past every prefix, as a static shape is
            meta = canvas_metadata(torch.tensor(starts), tables, cl, context, geometry(model, CACHE))
            logits = model(ids, meta, kv)
        else:
            logits = _forward(model, kv, [Row(slot, n, cl, True, _blocks(slot)) for slot, n in enumerate(starts)],
                              ids.tolist())
    return logits[:cl]


def test_a_canvas_denoises_the_same_alone_in_a_batch_and_in_the_static_step(model):
    alone = _canvas_logits(model, 37, [], static=False)
    assert torch.equal(_canvas_logits(model, 37, [5, 37, 140], static=False), alone)
    assert torch.equal(_canvas_logits(model, 37, [], static=True), alone)
    assert torch.equal(_canvas_logits(model, 37, [90, 3], static=True), alone)
