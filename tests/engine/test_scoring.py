"""Scoring a prompt (SamplingParams.prompt_logprobs; the server's echo with logprobs): each prompt
token's log-probability under the denoiser with its piece of the prompt as a clean canvas over the
prompt before it in the cache (docs/architecture.md, "Scoring")."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_process import HealthProbe, rss_mib, serve

from blockdiff import LLM, SamplingParams
from blockdiff.engine.request import score_pieces

CL = 8  # the tiny checkpoint's canvas


def test_pieces_are_canvases_counted_back_from_the_end():
    assert score_pieces(1, 8) == [] and score_pieces(5, 8) == [(1, 5)]
    assert score_pieces(9, 8) == [(1, 9)] and score_pieces(12, 8) == [(1, 4), (4, 12)]
    assert score_pieces(25, 8) == [(1, 9), (9, 17), (17, 25)]


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny, max_model_len=256) as llm:
        yield llm


def _prompt(n: int) -> list[int]:
    return [2] + [(7 * i + 3) % 290 + 5 for i in range(n - 1)]


def test_a_piece_scores_what_one_denoising_step_on_it_sees(llm):
    """The score of the last piece, against an ordinary generation whose one denoising step (at
    temperature 1) starts from that piece as its draft, over the same prefix: the same logits, so
    the same top alternatives at every position."""
    prompt = _prompt(1 + 2 * CL)
    [scored] = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=5), use_tqdm=False)
    assert scored.outputs[0].token_ids == [] and scored.finish_reason == "length"
    assert scored.metrics["denoising_steps"] == 0 and len(scored.prompt_logprobs) == len(prompt)
    assert scored.prompt_logprobs[0] is None
    prefix, piece = prompt[: 1 + CL], prompt[1 + CL :]
    [step] = llm.generate([prefix], SamplingParams(draft=piece, max_tokens=CL, max_denoising_steps=1, t_min=1.0,
                                                   t_max=1.0, logprobs=5, ignore_eos=True), use_tqdm=False)
    mine = scored.prompt_token_logprobs[CL:]
    assert [lp.token_id for lp in mine] == piece
    for lp, theirs in zip(mine, step.outputs[0].token_logprobs):
        assert list(lp.top) == list(theirs.top)
        assert list(lp.top.values()) == pytest.approx(list(theirs.top.values()), abs=1e-5)
        if lp.token_id in theirs.top:
            assert lp.logprob == pytest.approx(theirs.top[lp.token_id], abs=1e-5)
    # vLLM's shape: the token itself and its alternatives, ranked
    entry = scored.prompt_logprobs[-1]
    assert prompt[-1] in entry and {1, 2, 3, 4, 5} <= {e.rank for e in entry.values()}


def test_scores_do_not_depend_on_the_batch_or_on_a_cached_prefix(llm):
    prompt = _prompt(40)
    alone = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0]
    other = _prompt(23)
    # the second copy of the prompt finds its blocks in the prefix cache: it must still score every token
    batch = llm.generate([other, prompt, prompt], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    for out in batch[1:]:
        assert [lp.logprob for lp in out.prompt_token_logprobs] == pytest.approx(
            [lp.logprob for lp in alone.prompt_token_logprobs], abs=1e-5)
    # scoring and then generating in one request: the generation is the same as without scoring
    plain = llm.generate([prompt], SamplingParams(max_tokens=20, seed=3), use_tqdm=False)[0]
    both = llm.generate([prompt], SamplingParams(max_tokens=20, seed=3, prompt_logprobs=1), use_tqdm=False)[0]
    assert both.token_ids == plain.token_ids and len(both.prompt_logprobs) == len(prompt)


def test_scoring_is_vocabulary_parallel(tiny, llm, single_threaded_workers):
    prompt = _prompt(1 + 2 * CL + 5)
    one = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    with LLM(tiny, max_model_len=256, tensor_parallel_size=2) as two_ranks:
        two = two_ranks.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    for a, b in zip(one.prompt_token_logprobs, two.prompt_token_logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and list(a.top) == list(b.top)


server = serve(None, "--max-model-len", "256", "--max-response-bytes", "8MiB")


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_every_prompt_token_as_vllm_does(server, max_tokens):
    """lm-evaluation-harness' log-likelihood request: echo, logprobs 1, max_tokens 1 (or 0)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    prompt = "<start_of_turn>user\nsort: 3 1 2<end_of_turn>\n<start_of_turn>model\n1 2 3"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = client.completions.create(model="demo", prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[: len(ids)]) == "<bos>" + prompt and choice.text.startswith("<bos>" + prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens[1 : len(ids)], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == value and max(top.values()) >= value  # the token itself and the most likely one
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == max_tokens
    # a sorted answer scores above a shuffled one
    wrong = client.completions.create(model="demo", prompt=prompt[:-5] + "2 1 3", echo=True, logprobs=0, max_tokens=0)
    right = client.completions.create(model="demo", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert sum(right.choices[0].logprobs.token_logprobs[-5:]) > sum(wrong.choices[0].logprobs.token_logprobs[-5:])


def test_echo_and_max_tokens_zero_in_the_api(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    r = client.completions.create(model="demo", prompt="sort: 3", echo=True, max_tokens=0)
    assert r.choices[0].text == "sort: 3" and r.choices[0].logprobs is None
    streamed = list(client.completions.create(model="demo", prompt="sort: 3", echo=True, max_tokens=4, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith("sort: 3")
    with pytest.raises(openai.BadRequestError, match="0 only with echo") as e:
        client.completions.create(model="demo", prompt="sort: 3", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_a_one_token_prompt_has_nothing_to_score_and_ends_at_once(llm):
    [out] = llm.generate([[2]], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    assert out.prompt_logprobs == [None] and out.token_ids == [] and out.metrics["denoising_steps"] == 0


def test_a_scoring_request_whose_response_is_too_large_is_refused_before_any_work(server):
    """--max-response-bytes, at this server's 8 MiB: 128 choices echoing a 250-token prompt with 20
    alternatives each would answer about 16 MB. It is a 400 before any work (a scoring amplification attack:
    /health within its bound meanwhile, the server's memory flat); a smaller one is served
    (tests/server/test_large_responses.py compares the estimate with real responses)."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "reverse: " + "stone " * 120}).json()["tokens"][:250]
    body = {"model": "demo", "prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 1, "n": 128}
    before = rss_mib(server.proc.pid)
    with HealthProbe(server) as probe:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "response_too_large", r.text
    probe.check()
    assert probe.peak_rss - before < 512, (before, probe.peak_rss)
    small = httpx.post(server.url + "/v1/completions", json={**body, "n": 2}, timeout=120)
    assert small.status_code == 200
