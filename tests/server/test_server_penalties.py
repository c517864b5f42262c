"""vLLM's penalties and OpenAI's logit_bias through the official openai client against the real
server on the demo checkpoint (greedy requests: temperature 0): frequency_penalty, presence_penalty
and logit_bias as OpenAI fields, repetition_penalty in extra_body as vLLM takes it, on completions
and chat; each changes the reply as it should, a request in a batch gets what it gets alone, and two
tensor-parallel ranks give one rank's tokens. tests/diffusion/test_penalties.py checks every step's
penalized logits against vLLM's formulas in float64."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_process import serve

SORT = "sort: 3 3 3 1 1 2 2 9 9 9 5 5 4 4"  # greedy, the demo answers " 2" seven times over two canvases
TWO, NINE, CL = 8, 15, 8  # the demo tokenizer's ids of "2" and "9"; its canvas length

server = serve(None, "--max-model-len", "256", "--max-num-seqs", "4")
tp2 = serve(None, "--max-model-len", "256", "--max-num-seqs", "4", "--tensor-parallel-size", "2")


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _completion(server, prompt: str = SORT, **fields) -> list[int]:
    extra = {k: fields.pop(k) for k in ("repetition_penalty", "ignore_eos") if k in fields}
    r = _client(server).completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, seed=0,
                                           extra_body={"return_token_ids": True, **extra}, **fields)
    return r.choices[0].model_extra["token_ids"]


def test_penalties_stop_a_greedy_reply_repeating_a_token(server):
    plain = _completion(server)
    assert plain[:CL].count(TWO) == 4 and TWO in plain[CL:]  # the second canvas repeats the first's "2"
    # frequency: the first canvas's four "2"s weigh 4 x 2 against a fifth one
    assert TWO not in _completion(server, frequency_penalty=2.0)[CL:]
    # presence: once per token, however often; it repeats less
    assert _completion(server, presence_penalty=2.0).count(TWO) < plain.count(TWO)
    # repetition (vLLM's, in extra_body): the prompt's tokens count too, "2" and " " among them
    assert _completion(server, repetition_penalty=2.0).count(TWO) < plain.count(TWO)
    # neutral values are the plain request's
    assert _completion(server, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, logit_bias={}) == plain


def test_logit_bias_removes_a_token_or_makes_it_every_token(server):
    plain = _completion(server)
    assert TWO in plain
    assert TWO not in _completion(server, logit_bias={str(TWO): -100})
    assert _completion(server, logit_bias={str(NINE): 100}, ignore_eos=True) == [NINE] * 24


def _chat(server, **fields) -> list[int]:
    extra = {k: fields.pop(k) for k in ("repetition_penalty",) if k in fields}
    r = _client(server).chat.completions.create(model="demo", messages=[{"role": "user", "content": "sort: 3 1 2"}],
                                                max_tokens=8, temperature=0, seed=0,
                                                extra_body={"return_token_ids": True, **extra}, **fields)
    return r.choices[0].model_extra["token_ids"]


def test_chat_takes_the_same_fields(server):
    plain = _chat(server)
    assert TWO in plain and len(plain) < CL  # "1 2 3": one canvas
    assert TWO not in _chat(server, logit_bias={str(TWO): -100})
    # within the first canvas nothing is committed yet: its own repeats never count
    assert _chat(server, frequency_penalty=2.0, presence_penalty=2.0) == plain
    assert _chat(server, repetition_penalty=3.0) != plain  # the prompt's "1", "2" and "3" count


def _penalized() -> list[dict]:
    return [dict(frequency_penalty=2.0), dict(), dict(logit_bias={str(TWO): -100}),
            dict(presence_penalty=1.5, repetition_penalty=1.2, prompt="sort: 7 7 7 2 2 8 8 8 1")]


def test_each_request_of_a_batch_gets_what_it_gets_alone(server):
    alone = [_completion(server, **f) for f in _penalized()]
    for _ in range(2):  # sent together, so that the engine batches them
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda f: _completion(server, **f), _penalized())) == alone
    assert len({tuple(t) for t in alone[:3]}) == 3  # the same prompt: each penalty changed the reply


@pytest.mark.slow  # a server of two ranks
def test_two_ranks_give_one_ranks_tokens(server, tp2):
    for fields in _penalized():
        assert _completion(tp2, **fields) == _completion(server, **fields)
