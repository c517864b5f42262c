"""vLLM's penalties and OpenAI's logit_bias (blockdiff/worker/penalties.py) against vLLM's formulas
in float64: on one rank's logits (what counts: the prompt, the committed output; per slot, in tiles,
on vocabulary shards; a neutral request's logits left exactly as they were), and through the engine
on the demo model: every step's penalized logits are vLLM's formulas applied to that step's logits,
over the prompt and the output committed before the canvas, on one rank and on two, through the
eager forward over rows and through the static canvas step (several steps per launch); greedy
requests give the same tokens on one rank and on two, and in a batch what they give alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import import_test_file, new_requests, vllm_penalized, whole_tables
from rank_checks import record_penalized_logits, recorded_penalties

from blockdiff import LLM, SamplingParams
from blockdiff.diffusion.entropy_bound import EntropyBound, denoise_params
from blockdiff.diffusion.vocab_parallel import VocabParallel
from blockdiff.sampling_params import REFERENCE_DEFAULTS
from blockdiff.model.attention_layout import Row
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.vocab import VocabShard
from blockdiff.step import NewRequests, Penalties
from blockdiff.worker.canvas_step import COMPILE_OPTIONS, canvas_step, context_of
from blockdiff.worker.penalties import SlotPenalties

V, CL, SLOTS = 37, 4, 4


def _penalties(rep=1.0, presence=0.0, frequency=0.0, prompt=(), output=(), bias=None) -> Penalties:
    bias = bias or {}
    return Penalties(rep, presence, frequency, torch.tensor(prompt, dtype=torch.long),
                     torch.tensor(output, dtype=torch.long), torch.tensor(list(bias), dtype=torch.long),
                     torch.tensor(list(bias.values()), dtype=torch.float32))


def _admit(pen: SlotPenalties, slots: list[int], penalties: list[Penalties | None]) -> None:
    n = len(slots)
    pen.admit(NewRequests(slots, [0] * n, [0] * n, [1] * n, [0] * n, [{}] * n, penalties=penalties))


REQUESTS = {
    0: (_penalties(1.7, -0.4, 0.6, prompt=[1, 2, 3, 2], output=[5, 5, 9], bias={3: -100.0, 7: 2.5, 30: 0.25}), [6, 5, 1, 11]),
    1: (None, [4, 4, 4, 4]),  # no penalties: its logits stay as they are
    2: (_penalties(0.5, prompt=[8, 9, 10]), [8, 12, 12, 0]),
}


def _admitted(shard: VocabShard) -> SlotPenalties:
    """Three requests in slots 0-2 (slot 0 readmitted with 3 output tokens committed before), each
    committing a canvas (its encoder row) after its prompt and earlier output."""
    pen = SlotPenalties(SLOTS, shard, torch.device("cpu"))
    _admit(pen, list(REQUESTS), [p for p, _ in REQUESTS.values()])
    rows, ids = [], []
    for slot, (p, canvas) in REQUESTS.items():
        start = 0 if p is None else len(p.prompt) + len(p.output)
        # slot 0's row starts 2 tokens early (its output's last two, recomputed): they count once
        head = [5, 9] if slot == 0 else []
        rows.append(Row(slot, start - len(head), len(head) + len(canvas), False))
        ids += head + canvas
    rows.append(Row(1, 0, CL, True))  # a canvas being denoised: nothing of it counts
    pen.count(rows, torch.tensor(ids, dtype=torch.long))
    return pen


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, CL, V, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("workspace", [None, 64], ids=["one tile", "tiles"])
def test_penalized_logits_are_vllms_in_float64_and_a_neutral_request_keeps_its_logits(workspace):
    shard = VocabShard.make(0, 1, V)
    pen = _admitted(shard)
    logits = _logits()
    out = logits.clone()
    pen.of([0, 1, 2]).apply(out, torch.tensor([0, 1, 2]), VocabParallel(shard, TPGroup(), workspace_bytes=workspace))
    for slot, (p, canvas) in REQUESTS.items():
        if p is None:
            assert torch.equal(out[slot], logits[slot])
            continue
        bias = dict(zip(p.bias_ids.tolist(), p.bias.tolist()))
        want = vllm_penalized(logits[slot], p.prompt.tolist(), p.output.tolist() + canvas, p.repetition, p.presence,
                              p.frequency, bias)
        torch.testing.assert_close(out[slot].double(), want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(out[slot], logits[slot])
    assert (out[0, :, 3] < -90).all()  # the bias of -100
    assert pen.of([1]) is None and pen.of([1, 2]) is pen  # a step of neutral canvases skips the work


def test_each_rank_penalizes_its_own_vocabulary_rows_as_one_rank_does():
    one = _logits(1)
    full = one.clone()
    _admitted(VocabShard.make(0, 1, V)).apply(full, torch.tensor([2, 0, 1]), VocabParallel(VocabShard.make(0, 1, V), TPGroup()))
    for rank in range(2):
        shard = VocabShard.make(rank, 2, V, 0)
        ids = shard.global_ids()
        local = torch.zeros(3, CL, shard.local_rows)
        local[..., ids >= 0] = one[..., ids[ids >= 0]]
        _admitted(shard).apply(local, torch.tensor([2, 0, 1]), VocabParallel(shard, TPGroup()))
        assert torch.equal(local[..., ids >= 0], full[..., ids[ids >= 0]])


def test_a_slot_taken_by_a_request_without_penalties_is_neutral_again():
    shard = VocabShard.make(0, 1, V)
    pen = _admitted(shard)
    _admit(pen, [0], [None])
    logits = _logits(2)
    out = logits.clone()
    pen.apply(out, torch.tensor([0, 1, 2]), VocabParallel(shard, TPGroup()))
    assert torch.equal(out[:2], logits[:2]) and not torch.equal(out[2], logits[2])
    assert pen.of([0, 1]) is None


@pytest.mark.slow  # one dynamo trace of the whole step: ~23 s on a shared machine
def test_the_compiled_step_penalizes_as_the_eager_step_does(checkpoints):
    """The static step compiled with the engine's options (fullgraph; dynamo's graph-only backend:
    the graph, no generated code) beside a canvas without penalties: the same outputs as the eager
    step, the penalized canvas's commit all the token a bias of 100 favours, the other canvas's
    outputs exactly those of a step without penalties."""
    torch._dynamo.reset()
    cache, tables, requests, steps = import_test_file("worker/test_canvas_step.py")._canvas_steps(checkpoints, 2, 32, True)
    graphs = []
    steps.fn = torch.compile(canvas_step, backend=lambda gm, _: graphs.append(gm) or gm.forward, **COMPILE_OPTIONS)
    cl = steps.state.canvas.shape[1]
    rows = [Row(slot, 3, cl, True, tuple(range(16 * slot, 16 * slot + 16))) for slot in range(2)]
    resolved = [EntropyBound().resolve(SamplingParams(), REFERENCE_DEFAULTS)] * 2
    params = denoise_params([3, 3], resolved, [0, 1])
    tables.apply(whole_tables(rows))
    admitted = new_requests(rows, [3, 3], resolved, [0, 1])
    requests.admit(admitted)
    admitted.penalties = [_penalties(1.5, 0.5, 1.0, prompt=[5, 6], output=[7, 7], bias={11: 100.0}), None]
    steps.penalties.admit(admitted)
    context, options = context_of(rows, cache.block_size), params.options()
    with torch.inference_mode():
        inputs, out = steps(rows, options)
        eager = canvas_step(*steps.step_args(context, inputs, options, 1, 0, True))
        plain = canvas_step(*steps.step_args(context, inputs, options))
    assert len(graphs) == 1
    for name in ("tokens", "logprob", "entropy", "finished"):
        torch.testing.assert_close(getattr(out, name)[:2], getattr(eager, name)[:2], rtol=1e-5, atol=1e-5)
    assert (eager.tokens[0] == 11).all() and not (plain.tokens[0] == 11).all()
    assert torch.equal(eager.tokens[1], plain.tokens[1]) and torch.equal(eager.logprob[1], plain.logprob[1])


# ---- through the engine, on the demo model ---------------------------------------------------
SORT = "sort: 3 3 3 1 1 2 2 9 9 9 5 5 4 4"  # the demo answers " 2" again and again, over canvases
GREEDY = dict(max_tokens=32, max_denoising_steps=8, seed=1, t_min=1e-6, t_max=2e-6)  # deterministic
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.8, logit_bias={8: 1.5, 33: -2.0})


def _recorded(prompts: list[str], params: list[SamplingParams], **options):
    """The outputs, the canvas length and per rank every penalized step (rank_checks.record_penalized_logits)."""
    with LLM(None, **options) as llm:
        ex = llm.engine.executor
        ranks = getattr(ex, "ranks", None)
        context = SimpleNamespace(state={"runner": getattr(ex, "runner", None)})
        if ranks is None:
            record_penalized_logits(context)
        else:
            ranks.run(record_penalized_logits)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        steps = [recorded_penalties(context)] if ranks is None else ranks.run(recorded_penalties, gather=True)
        return outputs, llm.engine.canvas_length, steps


def _full(shards: list[dict], key: str, vocab: int) -> torch.Tensor:
    full = torch.full((*shards[0][key].shape[:-1], vocab), torch.nan)
    for s in shards:
        real = s["ids"] >= 0
        full[..., s["ids"][real]] = s[key][..., real]
    assert not full.isnan().any()
    return full


# ~10 s at two ranks
@pytest.mark.parametrize("options", [dict(num_scheduler_steps=1), dict(num_scheduler_steps=4),
                                     dict(tensor_parallel_size=2, num_scheduler_steps=4)],
                         ids=["rows", "static", "tp2"])
def test_every_steps_penalized_logits_are_vllms_in_float64(options, single_threaded_workers):
    params = SamplingParams(**GREEDY, **PENALTIES, ignore_eos=True)  # all 32 tokens: four canvases
    (out,), cl, per_rank = _recorded([SORT], [params], **options)
    vocab = max(int(s["ids"].max()) for s in (r[0] for r in per_rank)) + 1
    assert len(out.token_ids) > cl  # several canvases: the committed output counts from the second on
    canvases = set()
    for i, step in enumerate(per_rank[0]):
        shards = [r[i] for r in per_rank]
        before, after = _full(shards, "before", vocab), _full(shards, "after", vocab)
        for row, (slot, k) in enumerate(zip(step["slots"].tolist(), step["canvas"].tolist())):
            if slot == step["scratch"]:
                assert torch.equal(after[row], before[row])  # a padded canvas (the scratch slot) keeps its logits
                continue
            want = vllm_penalized(before[row], out.prompt_token_ids, out.token_ids[: k * cl], params.repetition_penalty,
                                  params.presence_penalty, params.frequency_penalty, params.logit_bias)
            torch.testing.assert_close(after[row].double(), want, rtol=1e-6, atol=1e-5)
            canvases.add(k)
    assert canvases == {0, 1, 2, 3}


def _tokens(prompts, params, **options) -> list[list[int]]:
    with LLM(None, **options) as llm:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ~18 s: seven engines, one of two ranks
@pytest.mark.slow
def test_penalized_requests_give_one_ranks_tokens_on_two_and_alone_what_they_give_in_a_batch(single_threaded_workers):
    prompts = [SORT, "upper: banana", SORT, "sort: 7 7 7 2 2 8 8 8 1"]
    params = [SamplingParams(**GREEDY, **PENALTIES), SamplingParams(**GREEDY, repetition_penalty=2.0),
              SamplingParams(**GREEDY), SamplingParams(**GREEDY, presence_penalty=2.0, logit_bias={100: -100})]
    batch = _tokens(prompts, params)
    alone = [_tokens([p], [q])[0] for p, q in zip(prompts, params)]
    assert batch == alone
    assert _tokens(prompts, params, tensor_parallel_size=2) == batch
    assert _tokens(prompts, params, num_scheduler_steps=1) == batch
    assert len({tuple(t) for t in batch}) == 4  # penalties changed what the same prompt gives (0 and 2)
