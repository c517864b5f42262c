"""vLLM's penalties and OpenAI's logit_bias through the engine (blockdiff/worker/penalties.py) on
the demo model: every step's penalized logits are vLLM's formulas applied in float64 to that step's
logits, over the prompt and the output committed before the canvas; on one rank and on two, through
the eager forward over rows and through the static canvas step (several steps per launch); greedy requests give the same tokens on one rank and on two,
and in a batch what they give alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import vllm_penalized
from rank_checks import record_penalized_logits, recorded_penalties

from blockdiff import LLM, SamplingParams

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
