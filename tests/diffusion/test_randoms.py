"""Counter-based random numbers on the device (diffusion/randoms.py): Philox4x32-10 as
Random123 defines it, a request's numbers a function of (seed, canvas, step, position) only, so that
seeded outputs are the same bits alone, in a batch of 8, after preemptions (for memory and for
fairness) and at two tensor-parallel ranks against one; and nothing random is drawn on the host
while the engine steps."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from blockdiff import LLM, SamplingParams
from blockdiff.diffusion import randoms
from blockdiff.engine.request import Request
from blockdiff.model.loader import load_model
from blockdiff.worker.kv_cache import cache_bytes_per_block, sliding_blocks_needed, sliding_bytes_per_block

M = randoms.MASK


@pytest.mark.parametrize("counter,key,want", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
], ids=["zeros", "ones", "pi"])
def test_philox_gives_random123s_known_answers(counter, key, want):
    """The known-answer vectors of Random123's kat_vectors file for philox4x32-10."""
    t = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    assert tuple(int(w) for w in randoms.philox(tuple(map(t, counter)), tuple(map(t, key)))) == want


def _words(seeds: list[int], canvases: list[int], steps: list[int], length: int = 16):
    seed = torch.tensor([randoms.seed_words(s) for s in seeds])
    return randoms.canvas_words(seed, torch.tensor(canvases), torch.tensor(steps), randoms.STEP, length)


def test_a_canvas_draws_the_same_numbers_alone_and_in_any_batch():
    alone = _words([2**64 + 5], [3], [7])
    batch = _words([11, 5, -7, 5], [3, 3, 0, 4], [7, 7, 7, 7])
    assert all(torch.equal(a[0], b[1]) for a, b in zip(alone, batch))  # 2^64 + 5 is seed 5
    assert not torch.equal(batch[0][1], batch[0][3])  # another canvas of the same request
    assert not torch.equal(batch[0][1], _words([5], [3], [6])[0][0])  # another step of the canvas


def test_the_numbers_are_uniform_words_floats_and_tokens():
    words = _words(list(range(256)), [0] * 256, [1] * 256, length=256)
    for w in words:
        assert w.dtype == torch.long and int(w.min()) >= 0 and int(w.max()) <= M
    u = randoms.uniform(words[0])
    assert u.dtype == torch.float32 and float(u.min()) >= 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.002
    tokens = randoms.below(words[1], 301)
    counts = torch.bincount(tokens.flatten(), minlength=301)
    assert counts.numel() == 301 and int(counts.min()) > 0.7 * 65536 / 301 and int(counts.max()) < 1.3 * 65536 / 301


def _draw_on_rank(ctx) -> tuple:
    return tuple(w.tolist() for w in _words([123, 2**63 + 9], [0, 2], [48, 1]))


def test_every_rank_draws_the_same_numbers_without_communicating(tp_ranks):
    """Each gloo rank computes the numbers itself; no collective runs."""
    draws = tp_ranks.run(_draw_on_rank, gather=True)
    assert all(d == draws[0] for d in draws) and draws[0] == _draw_on_rank(None)


@pytest.mark.slow  # an inductor compile of the generator: ~15 s
def test_the_compiled_generator_gives_the_eager_bits():
    seed = torch.tensor([randoms.seed_words(s) for s in (1, 2**40 + 3, 99)])
    canvas, step = torch.tensor([0, 5, 1]), torch.tensor([4, 1, 9])

    def draw(seed, canvas, step):
        words = randoms.canvas_words(seed, canvas, step, randoms.STEP, 64)
        return randoms.uniform(words[0]), randoms.below(words[1], 262144)

    eager = draw(seed, canvas, step)
    compiled = torch.compile(draw, fullgraph=True, dynamic=False)(seed, canvas, step)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


class _RandomOps(TorchFunctionMode):
    """Records every random-number call made through torch while active."""

    NAMES = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
             "multinomial", "normal", "poisson", "uniform_", "normal_", "random_", "bernoulli_", "exponential_",
             "geometric_", "cauchy_", "log_normal_"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_no_random_number_is_drawn_on_the_host_while_the_engine_steps(tiny):
    """Sampled requests with drafts, several canvases and restricted draws: no torch random op runs
    during any engine step, and the process's generator is where it was."""
    assert "generator" not in Request.__dataclass_fields__
    params = [SamplingParams(max_tokens=20, max_denoising_steps=4, seed=s, ignore_eos=True, **kw)
              for s, kw in ((1, {}), (2, dict(top_k=5, top_p=0.8)), (3, dict(draft=[9] * 5)))]
    with LLM(tiny) as llm:
        engine = llm.engine
        reqs = [engine.add_request(prompt, p) for p, prompt in zip(params, ([4, 5, 6], [7] * 9, [8, 9]))]
        before = torch.random.get_rng_state()
        mode = _RandomOps()
        steps = 0
        while engine.has_unfinished():
            with mode:
                engine.step()
            steps += 1
        denoised = sum(r.metrics.denoising_steps for r in reqs)
        assert steps > 3 and denoised >= 30 and mode.calls == [] and torch.equal(torch.random.get_rng_state(), before)


# ---- seeded outputs, end to end ---------------------------------------------------------------
BS, MAX_MODEL_LEN = 16, 128


def _cases() -> list[tuple[list[int], SamplingParams]]:
    """Eight sampled requests: prompt lengths across the sliding window, two to five canvases, a
    scaled schedule, a restricted draw, a draft."""
    out = []
    for i in range(8):
        prompt = torch.randint(3, 301, (3 + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        extra = [{}, dict(temperature=0.7), dict(top_k=7), dict(draft=[11] * 9)][i % 4]
        out.append((prompt, SamplingParams(max_tokens=16 + 6 * i, max_denoising_steps=3 + i % 3, seed=40 + i,
                                           ignore_eos=True, **extra)))
    return out


def _kv_bytes(tiny: str, blocks: int, seqs: int) -> int:
    model = load_model(tiny)
    sliding = sliding_blocks_needed(model.config.window_past(MAX_MODEL_LEN), model.config.canvas_length, BS, seqs, 64)
    return sliding_bytes_per_block(model, BS) * sliding + cache_bytes_per_block(model, BS) * blocks


def _run(llm: LLM, cases) -> list[list[int]]:
    return [o.token_ids for o in llm.generate([p for p, _ in cases], [s for _, s in cases], use_tqdm=False)]


def test_seeded_outputs_are_the_same_alone_in_a_batch_of_8_and_after_preemptions(tiny):
    """Sampled at the default temperatures on a random model, where the last bit of a logit can
    change a token: each request alone, all eight in one batch, with a cache too small for them
    (preempted for memory while prefilling, denoising and committing, and recomputed), and with
    fewer slots than requests and preemption for fairness after every canvas."""
    cases = _cases()
    opts = dict(block_size=BS, max_model_len=MAX_MODEL_LEN, max_prefill_tokens=64)
    with LLM(tiny, **opts) as llm:
        alone = [_run(llm, [c])[0] for c in cases]
        assert _run(llm, cases) == alone
    with LLM(tiny, max_num_seqs=8, kv_cache_memory=_kv_bytes(tiny, 14, 8), **opts) as llm:
        assert _run(llm, cases) == alone
        assert llm.engine.scheduler.num_preemptions >= 4
    with LLM(tiny, max_num_seqs=3, preempt_after_canvases=1, **opts) as llm:
        assert _run(llm, cases) == alone
        assert llm.engine.scheduler.num_preemptions >= 4


@pytest.mark.slow  # two engines, one of two ranks: ~20 s on 2 cores
def test_seeded_outputs_at_two_ranks_equal_one_rank(single_threaded_workers):
    """The demo model, eight sampled requests: each rank draws the step's numbers itself, and the
    tokens are those of one rank. (On a random checkpoint, whose distributions are nearly uniform,
    a row-parallel sum that rounds its last bit differently from one rank's product can move a
    near-tie; the random numbers themselves are every rank's alike, above.)"""
    prompts = ["12+30=", "reverse: hello", "sort: 93172", "12+7=", "reverse: stone", "sort: 5821", "3+4=", "reverse: abc"]
    params = [SamplingParams(max_tokens=24, seed=s) for s in range(len(prompts))]
    with LLM() as llm:
        one = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(tensor_parallel_size=2) as llm:
        two = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert one == two and len({tuple(t) for t in one}) == len(prompts)
