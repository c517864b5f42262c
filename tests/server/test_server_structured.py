"""Structured outputs through the real server: the official openai client's response_format, vLLM's
structured_outputs and guided_* fields, streaming, langchain's with_structured_output, and the 400s
of what cannot be guaranteed; on a random tiny checkpoint, whose text is noise, every output
validates."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_process import ServerProcess, fixture_value, serve
from helpers import import_test_file

_structured = import_test_file("structured/test_structured_outputs.py")
CHOICES, REGEXES, SCHEMAS, make_json_tiny = _structured.CHOICES, _structured.REGEXES, _structured.SCHEMAS, _structured.make_json_tiny


@pytest.fixture(scope="module")
def json_tiny(tmp_path_factory) -> str:
    return make_json_tiny(str(tmp_path_factory.mktemp("json_tiny")))


server = serve(fixture_value("json_tiny"), "--max-model-len", "256", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema(client, name):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Give me JSON"}], n=3, seed=7,
                                       max_tokens=64, response_format=json_schema(name))
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_streamed_json_schema(client):
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Stream JSON"}], seed=3,
                                            max_tokens=64, response_format=json_schema("nested"), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_json_object(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "An object"}], n=2, seed=1,
                                       max_tokens=48, response_format={"type": "json_object"})
    assert all(isinstance(json.loads(c.message.content), dict) for c in r.choices)


def test_vllm_fields_on_completions(client):
    """structured_outputs and the older guided_* spellings, on the completions endpoint."""
    for body, ok in [
        ({"structured_outputs": {"regex": REGEXES[0]}}, lambda t: re.fullmatch(REGEXES[0], t)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_regex": REGEXES[1]}, lambda t: re.fullmatch(REGEXES[1], t)),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"guided_json": SCHEMAS["numbers"]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS["numbers"]) is None),
        ({"structured_outputs": {"json": json.dumps(SCHEMAS["array_enum"])}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMAS["array_enum"]) is None),
    ]:
        r = client.completions.create(model="tiny", prompt="Answer:", n=2, seed=5, max_tokens=48, extra_body=body)
        for choice in r.choices:
            assert ok(choice.text), (body, choice.text)


@pytest.mark.parametrize("body, param, why", [
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs", "context-free grammars are not supported"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "context-free grammars are not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "maximum": 3}}}},
     "response_format", "'maximum' is not supported"),
    ({"guided_regex": "(open"}, "guided_regex", "cannot be built"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "both constrain the output"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"guided_choice": ["abcdefgh"], "max_tokens": 1}, "max_tokens", "too small for the structured output"),
])
def test_what_cannot_be_guaranteed_is_a_400(server, body, param, why):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                                "max_tokens": 16, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert why in error["message"] and error["param"] == param, error
    assert httpx.get(server.url + "/health").status_code == 200


def test_langchain_with_structured_output(server):
    """langchain's ChatOpenAI as it is: a plain reply, and with_structured_output (response_format with
    the pydantic model's JSON schema), whose reply always parses into the model."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """Someone."""

        name: str = Field(description="their name", max_length=8)
        age: int
        likes: list[str] = Field(max_length=2)

    llm = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key="none", max_tokens=64, seed=0, max_retries=0)
    assert llm.invoke("Describe a person.").response_metadata["finish_reason"] in ("stop", "length")  # the client works...
    for seed in range(2):
        person = llm.bind(seed=seed).with_structured_output(Person).invoke("Describe a person.")
        assert isinstance(person, Person)  # ...and its structured output parses


def test_two_ranks_through_the_server(json_tiny, tmp_path):
    proc = ServerProcess(json_tiny, "--max-model-len", "256", "--tensor-parallel-size", "2", log_path=str(tmp_path / "server.log"))
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=json_tiny, messages=[{"role": "user", "content": "JSON"}], n=2, seed=1,
                                           max_tokens=64, response_format=json_schema("array_enum"))
        for choice in r.choices:
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS["array_enum"])
    finally:
        proc.close()
