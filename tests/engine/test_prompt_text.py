"""Prompt text is never lost silently: characters the tokenizer lacks are logged with the request id,
and an empty prompt is refused in every form (text, ids; server and offline alike)."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from server_process import serve

from blockdiff import LLM, SamplingParams

UNENCODABLE = "upper: 中文😀"


demo_server = serve(None, "--max-model-len", "64")


def test_unencodable_text_is_answered_with_a_warning_naming_the_request(demo_server):
    client = openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": UNENCODABLE}], max_tokens=8)
    done = client.completions.create(model="demo", prompt="héllo", max_tokens=8)
    plain = client.completions.create(model="demo", prompt="hello", max_tokens=8)
    log = demo_server.log()
    assert f"request {chat.id}: the tokenizer has no token for 3 character(s) '中文😀'" in log
    assert f"request {done.id}: the tokenizer has no token for 1 character(s) 'é'" in log
    assert f"request {plain.id}" not in log


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]], ids=["text", "ids", "list-of-text", "list-of-ids"])
def test_empty_prompt_is_refused_in_every_form(demo_server, prompt):
    r = httpx.post(demo_server.url + "/v1/completions", json={"model": "demo", "prompt": prompt}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "prompt is empty" and r.json()["error"]["param"] == "prompt"


def test_oversized_max_tokens_names_max_tokens(demo_server):
    for field, endpoint, body in [("max_tokens", "completions", {"prompt": "hi"}),
                                  ("max_completion_tokens", "chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        r = httpx.post(f"{demo_server.url}/v1/{endpoint}", json={"model": "demo", field: 100, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert f"{field} (100) + prompt" in r.json()["error"]["message"]


def test_offline_api_warns_and_refuses_alike(caplog):
    with LLM(max_model_len=64) as llm:
        with caplog.at_level(logging.WARNING, logger="blockdiff"):
            out = llm.chat([{"role": "user", "content": UNENCODABLE}], SamplingParams(max_tokens=8), use_tqdm=False)
        assert out[0].finish_reason in ("stop", "length")
        assert "conversation 0: the tokenizer has no token for 3 character(s) '中文😀'" in caplog.text
        for empty in ("", [[]], ["hi", ""]):
            with pytest.raises(ValueError, match="prompt is empty"):
                llm.generate(empty, use_tqdm=False)
        assert not llm.engine.has_unfinished()  # nothing of a refused batch was left behind


def test_chat_text_parts_read_as_one_string():
    """OpenAI clients send content as a list of text parts; the demo template reads strings, so the
    parts must reach it joined (they once rendered as an empty message) and other parts are refused."""
    greedy = SamplingParams(max_tokens=8, temperature=0)
    with LLM(max_model_len=64) as llm:
        plain = llm.chat([{"role": "user", "content": "sort: 3 1 2"}], greedy, use_tqdm=False)[0]
        parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "sort: "}, {"type": "text", "text": "3 1 2"}]}],
                         greedy, use_tqdm=False)[0]
        assert parts.prompt_token_ids == plain.prompt_token_ids
        assert parts.token_ids == plain.token_ids
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: 'input_audio' parts are not supported"):
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}], use_tqdm=False)
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: 'input_audio' parts are not supported"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "input_audio"}]}],
                     use_tqdm=False)
        assert not llm.engine.has_unfinished()
