"""The engine's core parts on their own, without a model: the request state machine, the block
allocator, the scheduler (admission, chunked prefill, fairness), entropy-bound acceptance, the
incremental detokenizer and stop checker, and the sampler-field table."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import typing
from array import array

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from blockdiff.demo import demo_checkpoint
from blockdiff.diffusion.entropy_bound import DenoiseParams, EntropyBound, denoise_params, entropy_bound_accept
from blockdiff.engine.block_allocator import BlockPool, block_keys
from blockdiff.engine.detokenizer import IncrementalDetokenizer
from blockdiff.engine.kv_cache_manager import KVCacheManager
from blockdiff.engine.request import IllegalTransition, Request, State
from blockdiff.engine.scheduler import Scheduler
from blockdiff.outputs import TokenLogprob
from blockdiff.arg_utils import add_sampling_args, sampling_overrides
from blockdiff.diffusion.registry import SAMPLERS
from blockdiff.entrypoints.openai.protocol import request_types
from blockdiff.sampling_params import PER_CANVAS_FIELDS, REFERENCE_DEFAULTS, SAMPLER_FIELDS, SamplingParams
from blockdiff.tokenizer import Tokenizer

CL = 4


def _request(rid: str, prompt: int = 3, max_tokens: int = 8, tokenizer=None, first: int = 1, **params) -> Request:
    """A request whose prompt is `prompt` tokens from `first` up (requests of the same `first` share a prefix)."""
    p = EntropyBound().resolve(SamplingParams(max_tokens=max_tokens, **params), REFERENCE_DEFAULTS)
    out = IncrementalDetokenizer(tokenizer, p.max_tokens, {0}, p.stop, False)
    return Request(rid, None, list(range(first, first + prompt)), p, CL, 0, out)


# ---- the request state machine ------------------------------------------------------------------
def test_every_legal_transition_and_illegal_ones_raise():
    req = _request("a", max_tokens=12)
    with pytest.raises(IllegalTransition):
        req.to(State.DENOISE)  # a waiting request has no cache to denoise against
    req.admit(0, 0)
    assert req.state == State.PREFILL
    req.cached(3)  # caught up with its prompt: the first canvas starts
    assert req.state == State.DENOISE and req.new_canvas is not None and req.steps_left == 48
    req.denoised(None)
    assert req.steps_left == 47 and req.metrics.denoising_steps == 1
    assert req.commit([5, 6, 7, 8], None) is None and req.state == State.COMMIT
    req.cached(4)
    assert req.state == State.DENOISE
    assert req.commit([5, 6, 7, 8], None) is None
    req.preempt()  # at a canvas boundary
    assert req.state == State.WAITING and req.slot is None and req.num_cached == 0
    req.admit(1, 0)
    req.cached(req.num_tokens)  # recomputed: prompt and both canvases
    assert req.num_cached == 11 and req.state == State.DENOISE
    assert req.commit([5, 6, 7, 8], None) == "length"
    req.finish("length")
    assert req.finished and req.state == State.FINISHED
    for state in State:
        with pytest.raises(IllegalTransition):
            req.to(state)
    with pytest.raises(IllegalTransition):
        _request("b").preempt()  # only an admitted request
    waiting = _request("c")
    waiting.finish("abort")
    assert waiting.state == State.ABORTED


def test_tokens_slices_prompt_and_output_without_joining_them():
    req = _request("a", prompt=3)
    req.output.token_ids.extend([10, 11, 12])
    assert req.tokens(0, 6) == [1, 2, 3, 10, 11, 12]
    assert req.tokens(2, 5) == [3, 10, 11] and req.tokens(4, 6) == [11, 12] and req.tokens(0, 2) == [1, 2]


# ---- the block pool ----------------------------------------------------------------------------
def test_block_pool_exhaustion_free_and_double_free():
    a = BlockPool(4, 16)
    assert a.blocks_for(0) == 0 and a.blocks_for(16) == 1 and a.blocks_for(17) == 2
    first = a.allocate(3)
    assert len(set(first)) == 3 and a.used == 3 and a.num_free == 1
    with pytest.raises(RuntimeError, match="exhausted"):
        a.allocate(2)
    a.free(first)
    assert a.used == 0 and a.num_free == 4
    with pytest.raises(RuntimeError, match="released twice"):
        a.free(first[:1])


def test_block_hashes_chain_and_shared_blocks_are_counted():
    keys = block_keys(list(range(10)), 4)
    # SHA-256 chained over the parent's key: what Python's hash() of (parent, tokens) was, predictably.
    first = hashlib.sha256(b"t" + array("q", [0, 1, 2, 3]).tobytes()).digest()
    assert keys == [first, hashlib.sha256(first + b"t" + array("q", [4, 5, 6, 7]).tobytes()).digest()]
    assert block_keys([4, 5, 6, 7], 4, parent=first) == keys[1:]
    # The same tokens after a different parent are another block; an image's digest is not an id.
    assert block_keys([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != keys[1]
    assert block_keys([0, 1, 2, b"\x03" + bytes(31)], 4) != keys[:1]
    pool = BlockPool(3, 4)
    [b] = pool.allocate(1)
    pool.register(b, keys[0])
    pool.share(b)  # a second request reuses it
    pool.free([b])
    assert pool.refs[b] == 1 and pool.num_free == 2  # still held by one
    pool.free([b])
    assert pool.lookup(keys[0]) == b and pool.num_free == 3  # free, but still cached
    pool.share(b)  # a hit takes it back out of the free queue
    assert pool.num_free == 2 and pool.refs[b] == 1
    off = BlockPool(3, 4, caching=False)
    off.register(0, keys[0])
    assert off.lookup(keys[0]) is None


def test_free_cached_blocks_are_evicted_last_and_least_recently_freed_first():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks[:3]):
        pool.register(b, block_keys([i] * 4, 4)[0])
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])  # holds no full block: handed out before any cached one
    pool.free([blocks[2]])
    assert pool.allocate(1) == [blocks[3]] and pool.lookup(block_keys([1] * 4, 4)[0]) == blocks[1]
    assert pool.allocate(1) == [blocks[1]]  # the least recently freed cached block goes first
    assert pool.lookup(block_keys([1] * 4, 4)[0]) is None and pool.lookup(block_keys([0] * 4, 4)[0]) == blocks[0]
    assert pool.allocate(2) == [blocks[0], blocks[2]] and not pool.cached


# ---- the scheduler ------------------------------------------------------------------------------
def _scheduler(slots: int, blocks: int, bs: int = 4, past: int = 100, sliding: int = 100, caching: bool = True,
               max_prefill_tokens: int = 100, preempt_after: int | None = None) -> Scheduler:
    kv = KVCacheManager(BlockPool(blocks, bs, caching), BlockPool(sliding, bs, caching), past)
    return Scheduler(slots, kv, max_prefill_tokens=max_prefill_tokens, preempt_after=preempt_after)


def _ids(out) -> list[str]:
    return [r.request_id for r, _ in out.encoder]


def _big_small_late(s: Scheduler, big_max_tokens: int) -> tuple[Request, Request, Request]:
    """A 7-token prompt, then two 3-token ones, queued in that order."""
    requests = _request("big", prompt=7, max_tokens=big_max_tokens), _request("s"), _request("l")
    for r in requests:
        s.add(r)
    return requests


def test_admission_takes_what_a_request_needs_now_first_come_first_served():
    s = _scheduler(3, 4)
    big, small, late = _big_small_late(s, 8)
    out = s.schedule()
    # big's prompt takes 2 blocks of 4 now, the others 1 each: all three run, though big alone
    # could commit 7 + 4 tokens (3 blocks) in the end.
    assert _ids(out) == ["big", "s", "l"] and not s.waiting and s.kv.full.num_free == 0
    assert big.blocks and len(big.blocks) == 2


def test_exhausted_blocks_preempt_the_newest_request_which_is_recomputed_later():
    s = _scheduler(3, 4)
    big, small, late = _big_small_late(s, 12)
    out = s.schedule()
    for r, n in out.encoder:
        s.cached(r, n)
    assert s.schedule().decoder == [big, small, late]
    late.denoised(None)  # late is mid-canvas: preempted, it denoises that canvas again from its start
    big.commit([7] * CL, None)  # positions 7..10: a third block, and none is free
    out = s.schedule()
    assert out.preempted == [late] and late.state == State.WAITING and late.metrics.preemptions == 1
    assert _ids(out) == ["big"] and out.decoder == [small] and list(s.waiting) == [late]
    assert late.new_canvas is None and late.metrics.canvases == 0 and late.blocks == [] and s.num_preemptions == 1
    s.cached(big, CL)
    small.finish("abort")
    s.release(small)
    out = s.schedule()  # small's block lets late in again, from its prompt
    assert out.decoder == [big] and [(r.request_id, n) for r, n in out.encoder] == [("l", 3)]
    assert s.kv.full.used == 4


def test_the_newest_request_preempts_itself_when_older_ones_hold_every_block():
    s = _scheduler(2, 3)
    a, b = _request("a", prompt=8, max_tokens=12), _request("b", prompt=4, max_tokens=12, first=20)
    s.add(a)
    s.add(b)
    out = s.schedule()
    for r, n in out.encoder:
        s.cached(r, n)
    s.schedule()
    b.commit([7] * CL, None)  # b needs a fourth block; a is older
    out = s.schedule()
    assert out.preempted == [b] and out.decoder == [a] and not out.encoder


def test_chunked_prefill_shares_the_token_budget():
    s = _scheduler(3, 10, max_prefill_tokens=5)
    a, b = _request("a", prompt=4), _request("b", prompt=4, first=20)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.encoder] == [("a", 4), ("b", 1)]
    for r, n in out.encoder:
        s.cached(r, n)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.encoder] == [("b", 3)] and out.decoder == [a]


def test_sliding_blocks_out_of_the_window_are_given_back_and_stay_cached():
    s = _scheduler(1, 10, bs=4, past=3)
    req = _request("a", prompt=10, max_tokens=8)
    s.add(req)
    s.schedule()
    assert len(req.sliding_blocks) == 3 and s.kv.sliding.used == 3
    s.cached(req, 10)
    # Positions 7, 8, 9 are all a query can still reach: block 0 (positions 0-3) and block 1 (4-7)...
    # block 1 holds position 7, so only block 0 goes.
    assert req.sliding_blocks[0] == -1 and min(req.sliding_blocks[1:]) >= 0 and s.kv.sliding.used == 2
    assert s.kv.sliding.lookup(block_keys([1, 2, 3, 4], 4)[0]) is not None  # freed, still cached for a prefix hit
    assert len(req.blocks) == 3 and s.kv.full.used == 3  # full layers keep everything


def _prefilled(s: Scheduler, rid: str, prompt: int) -> Request:
    """A request admitted and its whole prompt run through the encoder."""
    req = _request(rid, prompt=prompt)
    s.add(req)
    s.schedule()
    s.cached(req, prompt)
    return req


def test_a_prefix_hit_reuses_full_blocks_and_the_sliding_blocks_its_window_reaches():
    s = _scheduler(2, 10, bs=4, past=3)
    a = _prefilled(s, "a", 10)
    b = _request("b", prompt=10)
    b.prompt_token_ids[9] = 40  # shares 9 tokens with a: the hit ends inside a block, at 8
    s.add(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.encoder] == [("b", 2)] and b.num_cached == 8
    assert b.blocks[:2] == a.blocks[:2] and b.sliding_blocks[1] == a.sliding_blocks[1] and b.sliding_blocks[0] == -1
    assert b.num_cached_prompt_tokens == 8 and (s.kv.queries, s.kv.hits) == (20, 8)
    # Whole prompt cached (a multiple of the block size): the canvas starts at once.
    c = _request("c", prompt=8)
    s.release(a)
    s.add(c)
    out = s.schedule()
    assert c.state == State.DENOISE and c in out.decoder and c.num_cached == 8


def test_a_hit_needs_the_sliding_blocks_before_its_end():
    s = _scheduler(2, 10, bs=4, past=3)
    a = _prefilled(s, "a", 10)
    s.release(a)
    s.kv.sliding.allocate(s.kv.sliding.num_free)  # every cached sliding block is evicted
    s.kv.sliding.free(list(range(100)))
    b = _request("b", prompt=10)
    s.add(b)
    s.schedule()
    assert b.num_cached == 0 and s.kv.hits == 0


def test_a_waiting_request_takes_the_slot_of_one_that_had_its_share():
    """One slot, held by a long request: at its canvas boundary after `preempt_after` canvases it
    gives the slot to the waiting request and goes to the back of the queue, with its output kept."""
    s = _scheduler(1, 8, caching=False, preempt_after=2)
    hog, small = _request("hog", max_tokens=24), _request("small")
    s.add(hog)
    s.schedule()
    s.cached(hog, 3)
    s.add(small)
    for canvas in range(2):
        assert s.schedule().decoder == [hog]
        hog.commit([7] * CL, None)
        out = s.schedule()
        if canvas == 0:  # one canvas is not its share yet: it commits
            assert [r for r, _ in out.encoder] == [hog] and not out.preempted
            s.cached(hog, CL)
    assert out.preempted == [hog] and hog.state == State.WAITING and list(s.waiting) == [hog]
    assert [r for r, _ in out.encoder] == [small] and small.slot == 0
    assert hog.output.token_ids == [7] * 8 and hog.metrics.preemptions == 1
    s.cached(small, 3)
    small.commit([0] + [7] * (CL - 1), None)  # EOS: done
    small.finish("stop")
    s.release(small)
    out = s.schedule()
    # Readmitted: the prompt and both canvases are recomputed in one prefill row.
    assert [(r, n) for r, n in out.encoder] == [(hog, 11)]


def test_a_prefilling_request_gives_its_slot_to_another_clients_request_and_keeps_its_work():
    """Long prompts (or scored ones, a piece a step) would hold their slots for as many steps as
    they take: another client's request takes one at once, their own client's waits. Readmitted,
    the request finds what it prefilled in the prefix cache."""
    s = _scheduler(2, 30, max_prefill_tokens=8, preempt_after=4)
    done, long = _request("done", prompt=12), _request("long", prompt=40, first=30)
    for r in (done, long):
        r.client = "a"
        s.add(r)
    mine = _request("mine", first=80)
    mine.client = "a"
    for step in range(3):  # done: 8 + 4 tokens; long: 4, then 8 (mine, of their own client, waits)
        out = s.schedule()
        assert not out.preempted
        for r, n in out.encoder:
            s.cached(r, n)
        if step == 0:
            s.add(mine)
    assert done.state == State.DENOISE and long.state == State.PREFILL and long.num_cached == 12
    other = _request("other", first=90)
    other.client = "b"
    s.add(other)
    out = s.schedule()
    assert out.preempted == [long] and _ids(out) == ["other"] and long.state == State.WAITING
    s.cached(other, 3)
    other.finish("abort")
    s.release(other)
    done.finish("abort")
    s.release(done)
    out = s.schedule()
    # Back of the queue, it finds its three blocks in the cache.
    assert _ids(out) == ["mine", "long"] and long.num_cached == 12


def test_a_request_waits_for_the_prefix_another_one_is_prefilling():
    """Choices of one prompt: the second would compute the same blocks beside the first; it waits
    a step and finds them cached. A request scoring its prompt cannot use them (it needs the
    prompt before each piece only), so it does not wait; nor does another prompt."""
    s = _scheduler(4, 20)
    a, b = _request("a", prompt=9), _request("b", prompt=9)
    scoring, other = _request("scoring", prompt=9, prompt_logprobs=0), _request("other", first=50)
    for r in (a, b, scoring, other):
        s.add(r)
    out = s.schedule()
    assert _ids(out) == ["a", "scoring", "other"] and list(s.waiting) == [b]
    for r, n in out.encoder:
        s.cached(r, n)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.encoder if r is b] == [("b", 1)] and b.num_cached_prompt_tokens == 8


def test_no_preemption_without_a_waiting_request_or_when_disabled():
    for preempt_after, waiting in ((1, False), (None, True)):
        s = _scheduler(1, 8, preempt_after=preempt_after)
        hog = _request("hog", max_tokens=24)
        s.add(hog)
        s.schedule()
        s.cached(hog, 3)
        if waiting:
            s.add(_request("small"))
        s.schedule()
        hog.commit([7] * CL, None)
        out = s.schedule()
        assert not out.preempted and [r for r, _ in out.encoder] == [hog]


# ---- entropy-bound acceptance -------------------------------------------------------------------
@pytest.mark.parametrize("entropy,bound,want", [
    ([0.3, 0.3, 0.3, 0.3], 0.65, [True, True, True, False]),  # all equal: ties keep their order
    ([0.0, 0.0, 0.0], 0.0, [True, True, True]),  # zeros are always accepted
    ([0.5, 0.1, 0.2], 0.0, [False, True, False]),  # bound 0: the lowest entropy alone
    ([5.0, 1.0, 9.0], float("inf"), [True, True, True]),  # no bound: everything
    ([0.2, 0.05, 0.1], 0.15, [True, True, True]),  # Σ before the last (0.05 + 0.1) <= bound
    ([0.2, 0.05, 0.1], 0.1, [False, True, True]),
])
def test_entropy_bound_accept(entropy, bound, want):
    got = entropy_bound_accept(torch.tensor([entropy]), torch.tensor([bound]))
    assert got.tolist() == [want]


# ---- the incremental detokenizer and stop checker -----------------------------------------------
def _byte_tokenizer() -> Tokenizer:
    """A byte-fallback BPE: characters outside the vocabulary become one token per UTF-8 byte."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for char in "▁abcdefghijklmnopqrstuvwxyz":
        vocab[char] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok, {}, None)


def _feed(det: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> tuple[list[str], str | None]:
    """Canvases ids[a:b] for consecutive cuts; -> the final text after each, and the finish reason."""
    seen, reason, start = [], None, 0
    for end in [*cuts, len(ids)]:
        reason = det.append(ids[start:end])
        seen.append(det.text)
        start = end
        if reason:
            break
    return seen, reason


def _random_outputs(tok: Tokenizer, rng: random.Random) -> list[int]:
    if tok.vocab_size > 300:  # the demo tokenizer: any ids
        return [rng.randrange(1, tok.vocab_size) for _ in range(rng.randrange(1, 40))]
    # Byte fallback: text with multi-byte characters (random bytes need not be UTF-8 at all).
    words = [" the", " a", "b", "é", " 日本", "ß", " end", "😀", " stop"]
    return tok.encode("".join(rng.choice(words) for _ in range(rng.randrange(1, 15))), add_special_tokens=False)


def test_incremental_text_equals_decoding_the_whole_output():
    for tok in (Tokenizer.from_pretrained(demo_checkpoint()), _byte_tokenizer()):
        rng = random.Random(0)
        for _ in range(40):
            ids = _random_outputs(tok, rng)
            cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randrange(0, 5)))) if len(ids) > 1 else []
            det = IncrementalDetokenizer(tok, len(ids), set(), None, False)  # the last canvas ends it
            seen, reason = _feed(det, ids, cuts)
            assert reason == "length" and det.text == tok.decode(ids), (ids, cuts)
            assert all(tok.decode(ids).startswith(t) for t in seen)  # text once given is never taken back


def test_a_character_split_across_canvases_waits_for_its_last_byte():
    tok = _byte_tokenizer()
    ids = tok.encode("a é b", add_special_tokens=False)
    second = ids.index(tok._tok.token_to_id("<0xA9>"))  # é is <0xC3> <0xA9>
    det = IncrementalDetokenizer(tok, len(ids), set(), None, False)
    assert det.append(ids[:second]) is None  # the canvas ends between é's two bytes
    assert "\ufffd" not in det.text and det.text == "a "
    assert det.append(ids[second:]) == "length" and det.text == "a é b"


def test_a_stop_string_split_across_canvases_cuts_text_and_tokens():
    tok = _byte_tokenizer()
    ids = tok.encode("a stop the end", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, 100, set(), ["op the"], False)
    split = 6  # "▁a▁sto" | "p▁the▁end"
    assert det.append(ids[:split]) is None and det.text + det.pending == "a sto"
    assert "o" not in det.text  # the tail a stop string may cut is held back
    assert det.append(ids[split:]) == "stop" and det.text == "a st"
    # The fewest tokens whose text reaches the end of the stop string are kept: "▁a▁stop▁the".
    assert det.token_ids == ids[:11]


def test_a_stop_token_inside_a_canvas_ends_the_output_and_its_text_is_left_out():
    tok = _byte_tokenizer()
    stop_id = tok._tok.token_to_id("z")
    ids = tok.encode("a the", add_special_tokens=False) + [stop_id] + tok.encode(" b", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, 100, {stop_id}, None, True)
    reason = det.append(ids, logprobs=[TokenLogprob(t, -1.0) for t in ids])
    assert reason == "stop" and det.token_ids == ids[: ids.index(stop_id) + 1]
    assert det.text == "a the" and det.ends_with_stop_token and len(det.logprobs) == len(det.token_ids)
    # each kept logprob holds its token's text (vLLM's Logprob.decoded_token)
    assert [lp.texts for lp in det.logprobs] == [{t: tok.decode([t], skip_special_tokens=False)} for t in det.token_ids]


def test_max_tokens_cuts_a_canvas():
    det = IncrementalDetokenizer(None, 6, set(), None, False)
    assert det.append([1, 2, 3, 4]) is None and det.append([5, 6, 7, 8]) == "length"
    assert det.token_ids == [1, 2, 3, 4, 5, 6]


# ---- one table of sampler fields ----------------------------------------------------------------
def test_the_plain_dataclasses_follow_the_sampler_field_table():
    """SamplingParams and DenoiseParams are written out (for type checkers and IDEs); their sampler
    fields are the table's, in its order, with its types."""
    hints = typing.get_type_hints(SamplingParams)
    fields = dataclasses.fields(SamplingParams)[: len(SAMPLER_FIELDS)]
    assert [f.name for f in fields] == [f.name for f in SAMPLER_FIELDS]
    for f, table in zip(fields, SAMPLER_FIELDS):
        assert hints[f.name] == (table.type | None) and f.default is None, f.name
    denoise = dataclasses.fields(DenoiseParams)
    assert [f.name for f in denoise] == ["step", "seed", "canvas", *(f.name for f in PER_CANVAS_FIELDS), "restrict", "fast"]
    assert all(typing.get_type_hints(DenoiseParams)[f.name] is torch.Tensor for f in denoise[:-2])


def test_every_surface_is_built_from_the_sampler_field_table():
    """SamplingParams, the OpenAI extra body of a model with each sampler, the CLI flags and the
    step inputs all carry every field of the sampler's table: adding a field there adds it everywhere."""
    names = {f.name for f in SAMPLER_FIELDS}
    assert names <= set(SamplingParams.__dataclass_fields__)
    assert {f.name for f in PER_CANVAS_FIELDS} <= set(DenoiseParams.__dataclass_fields__)
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    for sampler in SAMPLERS.values():
        completion, chat = request_types(sampler.fields)
        per_canvas = {f.name for f in sampler.fields if f.per_canvas}
        assert per_canvas <= set(completion.model_fields) and per_canvas <= set(chat.model_fields)
        given = {f.name: f.default for f in sampler.fields if f.default is not None}  # max_tokens: none, what fits
        args = parser.parse_args([arg for name, v in given.items() for arg in ("--" + name.replace("_", "-"), str(v))])
        assert sampling_overrides(args) == given
    params = EntropyBound().resolve(SamplingParams(), REFERENCE_DEFAULTS)
    d = denoise_params([3], [params], [0])
    for f in PER_CANVAS_FIELDS:
        # an exact-mode canvas (the default) carries settle_steps 0: it never settles
        want = 0 if f.name == "settle_steps" else f.default
        assert getattr(d, f.name).dtype == getattr(torch, f.dtype) and getattr(d, f.name).item() == pytest.approx(want)


@pytest.mark.parametrize("values,field", [
    ({"stability_threshold": 2**63}, "stability_threshold"),  # once an overflow inside the engine
    ({"max_denoising_steps": 2**31}, "max_denoising_steps"),
    ({"t_max": 3.5e38}, "t_max"),
    ({"entropy_bound": float("nan")}, "entropy_bound"),
    ({"confidence_threshold": 1e39}, "confidence_threshold"),
])
def test_values_outside_their_dtype_are_refused(values, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**values)


@pytest.mark.parametrize("values,field", [
    ({"temperature": 1e-300}, "temperature"),
    ({"temperature": 1e300}, "temperature"),
    ({"t_min": 0.0, "t_max": 1e-46}, "t_min"),
    ({"t_min": 0.0, "t_max": 1e-19, "max_denoising_steps": 48}, "t_min"),
])
def test_schedules_that_would_divide_by_a_subnormal_are_refused(values, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        EntropyBound().resolve(SamplingParams(**values), REFERENCE_DEFAULTS)


def test_the_lowest_accepted_temperature_gives_finite_sampler_output():
    """At the floor the sampler still yields finite entropies and valid tokens (no NaN)."""
    from blockdiff.diffusion.entropy_bound import denoise_step
    from blockdiff.diffusion.vocab_parallel import VocabParallel
    from blockdiff.parallel.group import TPGroup
    from blockdiff.parallel.vocab import VocabShard

    params = EntropyBound().resolve(SamplingParams(t_min=0.0, t_max=2e-20 * 48 * 1.01, max_denoising_steps=48), REFERENCE_DEFAULTS)
    logits = (torch.rand(2, CL, 37) * 60 - 30)
    d = denoise_params([1, 1], [params, params], [1, 2])
    res = denoise_step(logits.clone(), torch.full((2, CL), -1), torch.zeros(2, dtype=torch.long), d,
                       VocabParallel(VocabShard.make(0, 1, 37), TPGroup()))
    assert torch.isfinite(res.entropy).all() and torch.equal(res.argmax, logits.argmax(-1))
    assert ((res.canvas >= 0) & (res.canvas < 37)).all()
