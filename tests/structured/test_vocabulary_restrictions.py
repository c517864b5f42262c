"""vLLM's vocabulary restrictions offline (blockdiff/structured/restrictions.py): allowed_token_ids
and bad_words as token automata, committed by the constrained commit, through LLM and
SamplingParams on the demo checkpoint; their automata against a brute-force check. The server's
side is in tests/server/test_request_fields.py."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from blockdiff import LLM, SamplingParams
from blockdiff.demo import demo_checkpoint
from blockdiff.sampling_params import StructuredOutputsParams
from blockdiff.step import Automaton
from blockdiff.structured.restrictions import bad_words_token_ids, product, vocabulary_automaton

SORT = [{"role": "user", "content": "sort: 3 1 2"}]


def _contains(seq: list[int], banned: list[list[int]]) -> bool:
    return any(seq[i : i + len(b)] == b for b in banned for i in range(len(seq) - len(b) + 1))


def test_the_bad_words_automaton_accepts_exactly_the_outputs_without_a_banned_sequence():
    banned = [[1], [2, 3], [3, 3, 4], [2, 3, 5]]
    a = vocabulary_automaton("k", 8, None, banned, (7,))
    assert a.atom_of[7] == -1 and a.final.all() and not a.distance.any()
    for n in range(1, 6):
        for seq in map(list, itertools.product(range(7), repeat=n)):
            try:
                a.walk(a.initial, seq)
                accepted = True
            except ValueError:
                accepted = False
            assert accepted == (not _contains(seq, banned)), seq


def test_allowed_token_ids_alone_are_one_state_over_their_tokens():
    a = vocabulary_automaton("k", 8, [0, 2, 3, 7], [], (7,))
    assert a.num_states == 1 and a.atom_of.tolist() == [0, -1, 0, 0, -1, -1, -1, -1]
    # With no end token allowed, every state must have a way on: 5 5 leads nowhere, so 5 does not
    # lead on either; a request that leaves no way on at all is refused.
    a = vocabulary_automaton("k", 8, [5, 6], [[5, 5, 5]], ())
    assert a.num_states == 3
    a = vocabulary_automaton("k", 8, [5, 6], [[6, 6], [5, 5]], ())
    assert a.walk(a.initial, [5, 6, 5, 6]) is not None
    for allowed, banned in (([5], [[5]]), ([5, 6], [[6], [5, 5]])):
        with pytest.raises(ValueError, match="bad_words"):
            vocabulary_automaton("k", 8, allowed, banned, ())


def _accepts(a, seq: list[int]) -> bool:
    try:
        return bool(a.final[a.walk(a.initial, seq)])
    except ValueError:
        return False


def test_the_product_accepts_what_both_automata_accept():
    """A structured output's automaton (here: outputs of 0s and 1s of even length, by hand) times a
    bad-words one: what both accept, and the fewest tokens to acceptance of the pairs of states."""
    atom_of = np.array([0, 0, 1, -1, -1, -1], dtype=np.int32)  # tokens 0, 1: atom 0; token 2: atom 1
    even = Automaton("even", 0, np.array([True, False]), np.array([0, 1]), atom_of, np.array([0, 1, 0], dtype=np.int32),
                     np.array([0, 0, 1], dtype=np.int32), np.array([1, 0, 0], dtype=np.int32))
    banned = [[0, 0], [1, 0, 1]]
    words = vocabulary_automaton("w", 6, None, banned, (5,))
    both = product("p", even, words)
    for n in range(0, 7):
        for seq in map(list, itertools.product(range(4), repeat=n)):
            assert _accepts(both, seq) == (_accepts(even, seq) and not _contains(seq, banned)), seq
    assert both.distance[both.initial] == 0 and both.atom_of[3] == -1
    with pytest.raises(ValueError, match="bad_words"):
        product("p", even, words, limit=4)


@pytest.fixture(scope="module")
def llm():
    with LLM(demo_checkpoint(), max_model_len=256) as llm:
        yield llm


def _reply(llm, **params):
    return llm.chat(SORT, SamplingParams(seed=0, max_tokens=8, **params), use_tqdm=False)[0]


def test_allowed_token_ids_offline(llm):
    tok = llm.get_tokenizer()
    plain = _reply(llm)
    assert plain.text == "1 2 3"
    one, space = tok.encode("1", add_special_tokens=False)[0], tok.encode(" ", add_special_tokens=False)[0]
    out = _reply(llm, allowed_token_ids=[one, space])
    assert set(out.token_ids) <= {one, space} and len(out.token_ids) == 8 and out.finish_reason == "length"
    # min_tokens holds as in vLLM: no EOS before it, and still only allowed tokens after it.
    eos = plain.token_ids[-1]
    allowed = set(plain.token_ids)
    out = llm.chat(SORT, SamplingParams(seed=0, max_tokens=12, min_tokens=8, allowed_token_ids=sorted(allowed)),
                   use_tqdm=False)[0]
    assert set(out.token_ids) <= allowed and len(out.token_ids) >= 8 and eos not in out.token_ids[:-1]
    with pytest.raises(ValueError, match="allowed_token_ids holds only end tokens"):
        _reply(llm, allowed_token_ids=[eos])
    # A structured output under allowed_token_ids: the one choice its tokens can spell.
    choice = StructuredOutputsParams(choice=["1 2 3", "3 2 1", "1 1 1"])
    out = _reply(llm, structured_outputs=choice, allowed_token_ids=[one, space, eos])
    assert out.text == "1 1 1" and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="allowed_token_ids: no output"):
        _reply(llm, structured_outputs=choice, allowed_token_ids=[space, eos])
    with pytest.raises(ValueError, match="allowed_token_ids: the structured output needs an end token"):
        _reply(llm, structured_outputs=choice, allowed_token_ids=[one, space])


def test_bad_words_offline(llm):
    tok = llm.get_tokenizer()
    assert _reply(llm, temperature=0).text == "1 2 3"
    for words in (["2"], ["1 2"]):
        out = _reply(llm, temperature=0, bad_words=words)
        assert out.text and not any(w in out.text for w in words)
    # vLLM's tokenization: the word as it is, and with a leading space where that is as many tokens.
    ids = bad_words_token_ids(tok, ["2", " 3"])
    assert ids[0] == tok.encode("2", add_special_tokens=False) and tok.encode("3", add_special_tokens=False) in ids
    # With a structured output: the product of the two automata.
    regex = StructuredOutputsParams(regex="[0-9]( [0-9])*")
    assert _reply(llm, temperature=0, structured_outputs=regex).text == "1 2 3"
    out = _reply(llm, temperature=0, structured_outputs=regex, bad_words=["2"])
    assert re.fullmatch("[0-9]( [0-9])*", out.text) and "2" not in out.text


@pytest.mark.parametrize("field,value", [("allowed_token_ids", [-1]), ("allowed_token_ids", []),
                                         ("allowed_token_ids", ["7"]), ("bad_words", [3]), ("bad_words", ["  "]),
                                         ("bad_words", "2"), ("bad_words", ["x"] * 129), ("bad_words", ["x" * 20000])])
def test_bad_values_are_a_value_error_naming_them(field, value):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and (not value or repr(value)[:8] in str(e.value) or "empty" in str(e.value)
                                       or "at most" in str(e.value))


def test_out_of_vocabulary_allowed_token_ids_offline(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids .*\[100000\]"):
        _reply(llm, allowed_token_ids=[7, 100000])
