"""vLLM's and OpenAI's request fields, sent as a vLLM user's scripts send
them, through the official openai client's extra_body, to the real server on the demo checkpoint:
every field is accepted, the ones that mean something here do what vLLM documents, unknown fields
are ignored with a warning (or refused with --strict-request-fields)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from server_process import serve

SORT = [{"role": "user", "content": "sort: 3 1 2"}]
# The demo tokenizer's ids of "1", "2", "3", " " and EOS: every token of the sorted reply.
REPLY_TOKENS = [7, 8, 9, 100, 1]
# Every vLLM and OpenAI field at a value a vLLM or OpenAI client sends (the vocabulary restrictions
# and prompt_logprobs at values that mean something, which leave the reply as it is).
FIELDS = {
    "include_stop_str_in_output": False, "add_generation_prompt": True, "continue_final_message": False,
    "chat_template_kwargs": {}, "documents": [], "truncate_prompt_tokens": -1, "priority": 0, "request_id": "r-1",
    "cache_salt": "tenant-a", "allowed_token_ids": REPLY_TOKENS, "bad_words": ["4"], "use_beam_search": False,
    "prompt_logprobs": 1,
    "return_tokens_as_token_ids": False, "add_special_tokens": False,
    "store": False, "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "medium",
    "modalities": ["text"], "prediction": {"type": "content", "content": "1 2 3"},
}
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents", "prompt_logprobs")


server = serve(None, "--max-model-len", "256")
strict = serve(None, "--max-model-len", "256", "--strict-request-fields", "--trust-request-chat-template")


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _tokens(server, **body) -> list[int]:
    return httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]


def test_every_field_is_accepted_and_the_ignored_ones_are_named_in_one_warning(server):
    client = _client(server)
    chat = client.chat.completions.create(model="demo", messages=SORT, seed=0, extra_body=FIELDS)
    assert chat.choices[0].message.content == "1 2 3" and chat.id == "chatcmpl-r-1"
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    completion = client.completions.create(model="demo", prompt="sort: 3 1 2", max_tokens=8, seed=0,
                                           extra_body={k: v for k, v in FIELDS.items() if k not in CHAT_ONLY})
    assert completion.id == "cmpl-r-1"
    log = server.log()
    assert "request fields ignored: store, service_tier, prompt_cache_key, safety_identifier, verbosity, modalities, " \
           "prediction" in log
    r = client.chat.completions.create(model="demo", messages=SORT, seed=0, extra_body={"no_such_field": 1})
    assert r.choices[0].message.content == "1 2 3" and "request fields ignored: no_such_field (unknown)" in server.log()


def test_strict_request_fields_refuse_unknown_ones(strict):
    r = httpx.post(strict.url + "/v1/chat/completions", json={"model": "demo", "messages": SORT, "no_such_field": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "no_such_field"
    assert "--strict-request-fields" in r.json()["error"]["message"]
    assert httpx.post(strict.url + "/v1/chat/completions", json={"model": "demo", "messages": SORT, **FIELDS},
                      timeout=60).status_code == 200


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("priority", 1), ("truncate_prompt_tokens", 0),
                                         ("allowed_token_ids", [10**6]), ("allowed_token_ids", []), ("bad_words", [" "]),
                                         ("prompt_logprobs", 21), ("prompt_logprobs", -1),
                                         ("chat_template", "{{ messages[0]['content'] }}")])
def test_values_that_cannot_be_honoured_are_a_400_naming_the_field(server, field, value):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "demo", "messages": SORT, field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    client = _client(server)

    def reply(**extra) -> str:
        return client.chat.completions.create(model="demo", messages=SORT, seed=0, stop=[" 2"], extra_body=extra) \
            .choices[0].message.content

    assert reply() == "1" and reply(include_stop_str_in_output=True) == "1 2"


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    client = _client(server)
    prompt = "reverse: " + "block " * 20
    full = client.completions.create(model="demo", prompt=prompt, max_tokens=4, seed=0).usage.prompt_tokens
    cut = client.completions.create(model="demo", prompt=prompt, max_tokens=4, seed=0,
                                    extra_body={"truncate_prompt_tokens": 7}).usage.prompt_tokens
    assert full > 7 and cut == 7


def test_generation_prompt_continuation_and_special_tokens_shape_the_prompt(server):
    """Each as /tokenize renders it, and as vLLM documents it: continue_final_message leaves the
    last (assistant) message open after its content. The demo's template writes its BOS itself,
    so add_special_tokens adds no second one."""
    client = _client(server)
    partial = [*SORT, {"role": "assistant", "content": "1 2"}]

    def prompt_tokens(messages, **extra) -> int:
        return client.chat.completions.create(model="demo", messages=messages, seed=0, max_tokens=8,
                                              extra_body=extra).usage.prompt_tokens

    bare = _tokens(server, messages=SORT, add_generation_prompt=False)
    assert prompt_tokens(SORT, add_generation_prompt=False) == len(bare) < len(_tokens(server, messages=SORT))
    continued = _tokens(server, messages=partial, continue_final_message=True)
    text = httpx.post(server.url + "/detokenize", json={"tokens": continued}).json()["prompt"]
    assert text.endswith("1 2") and prompt_tokens(partial, continue_final_message=True) == len(continued)
    assert prompt_tokens(SORT, add_special_tokens=True) == len(_tokens(server, messages=SORT))


def test_return_tokens_as_token_ids_spells_logprob_tokens_by_id(server):
    r = _client(server).chat.completions.create(model="demo", messages=SORT, seed=0, logprobs=True, top_logprobs=1,
                                                extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in choice.model_extra["token_ids"]]
    assert all(top.token.startswith("token_id:") for e in entries for top in e.top_logprobs)


def test_a_trusted_request_template_and_its_documents_render_the_prompt(strict):
    """The request's template (which writes no BOS) renders its documents before the message;
    add_special_tokens then puts the BOS before it."""
    template = "{% for d in documents %}{{ d['text'] }} {% endfor %}{{ messages[-1]['content'] }}"
    docs = [{"text": "reverse: a"}, {"text": "reverse: b"}]
    client = _client(strict)

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model="demo", messages=SORT, seed=0, max_tokens=8,
                                              extra_body={"chat_template": template, "documents": docs, **extra}).usage.prompt_tokens

    with_bos = _tokens(strict, prompt="reverse: a reverse: b sort: 3 1 2")  # a prompt gets the BOS by default
    assert prompt_tokens() == len(with_bos) - 1 and prompt_tokens(add_special_tokens=True) == len(with_bos)


def test_cache_salt_keeps_prefix_cache_entries_apart(server):
    """The same long prompt twice: the second is served from the prefix cache, unless its salt differs."""
    client = _client(server)
    prompt = "reverse: " + "prefix cache " * 8

    def cached(**extra) -> int:
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=4, seed=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached(cache_salt="a")
    assert cached(cache_salt="a") > 0
    assert cached(cache_salt="b") == 0 and cached() == 0


def _reply(server, **extra):
    """The sorted reply's choice, its token ids with it."""
    return _client(server).chat.completions.create(model="demo", messages=SORT, seed=0, max_tokens=8,
                                                   extra_body={"return_token_ids": True, **extra}).choices[0]


def test_allowed_token_ids_restrict_the_generated_tokens(server):
    """vLLM's allowed_token_ids: only those tokens are generated, each logprob entry too; an EOS
    that is not among them never ends the output, so max_tokens does."""
    plain = _reply(server)
    one, two, space = (_tokens(server, prompt=t, add_special_tokens=False)[0] for t in ("1", "2", " "))
    allowed = {one, two, space}
    assert not set(plain.model_extra["token_ids"]) <= allowed and plain.finish_reason == "stop"
    r = _reply(server, allowed_token_ids=sorted(allowed), logprobs=True, return_tokens_as_token_ids=True)
    ids = r.model_extra["token_ids"]
    assert set(ids) <= allowed and len(ids) == 8 and r.finish_reason == "length"
    assert [e.token for e in r.logprobs.content] == [f"token_id:{t}" for t in ids]
    eos = REPLY_TOKENS[-1]
    stopped = _reply(server, allowed_token_ids=sorted(allowed | {eos}))
    assert set(stopped.model_extra["token_ids"]) <= allowed | {eos} and stopped.finish_reason == "stop"
    completion = _client(server).completions.create(model="demo", prompt="sort: 3 1 2", max_tokens=6, seed=0,
                                                    extra_body={"allowed_token_ids": [one], "return_token_ids": True})
    assert completion.choices[0].model_extra["token_ids"] == [one] * 6


def test_out_of_vocabulary_allowed_token_ids_are_a_400(server):
    for body in ({"messages": SORT}, {"prompt": "sort: 3 1 2"}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(server.url + path, json={"model": "demo", **body, "allowed_token_ids": [3, 10**6]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
        assert str(10**6) in r.json()["error"]["message"]


def test_bad_words_keep_a_word_of_the_greedy_reply_out(server):
    assert _reply(server, temperature=0).message.content == "1 2 3"
    for words in (["2"], ["1 2"], [" 3"]):
        content = _reply(server, temperature=0, bad_words=words).message.content
        assert all(w.strip() not in content for w in words) and content, (words, content)
    completion = _client(server).completions.create(model="demo", prompt="sort: 3 1 2", max_tokens=8, seed=0,
                                                    temperature=0, extra_body={"bad_words": ["2"]})
    assert "2" not in completion.choices[0].text
    # With a structured output: both hold.
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": SORT, "bad_words": ["2"], "temperature": 0,
        "structured_outputs": {"regex": "[0-9]( [0-9])*"}})
    content = r.json()["choices"][0]["message"]["content"]
    assert re.fullmatch("[0-9]( [0-9])*", content) and "2" not in content, r.text


def test_chat_prompt_logprobs_score_the_prompt_as_completions_do(server):
    """vLLM's shape: at the response's top level, one entry per prompt token, None for the first,
    then {token id: {logprob, rank, decoded_token}} holding the token and its alternatives; the
    same scores as /v1/completions gives the same ids with echo and logprobs."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "demo", "messages": SORT, "seed": 0, "max_tokens": 4, "prompt_logprobs": 2}).json()
    ids = _tokens(server, messages=SORT)
    scores = r["prompt_logprobs"]
    assert len(scores) == len(ids) == r["usage"]["prompt_tokens"] and scores[0] is None
    for t, entry in zip(ids[1:], scores[1:]):
        assert str(t) in entry and 2 <= len(entry) <= 3
        assert set(entry[str(t)]) == {"logprob", "rank", "decoded_token"}
        ranked = sorted(e["rank"] for k, e in entry.items() if e["rank"] is not None)
        assert ranked == [1, 2]
    echo = _client(server).completions.create(model="demo", prompt=ids, max_tokens=0, echo=True, logprobs=2)
    expected = echo.choices[0].logprobs.token_logprobs
    assert expected[0] is None and len(expected) == len(ids)
    assert [scores[i][str(t)]["logprob"] for i, t in enumerate(ids) if i] == pytest.approx(expected[1:], abs=1e-4)
    assert httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": SORT, "max_tokens": 4}).json()["prompt_logprobs"] is None
    streamed = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": SORT, "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
