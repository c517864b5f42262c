"""LoRA adapters through the real server and the official openai client (docs/lora.md): adapters
named as the request's model, listed in /v1/models, loaded (from --lora-modules-dir) and unloaded
at runtime; an unknown adapter is a 404."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import openai
import pytest
from helpers import import_test_file
from server_process import serve

from blockdiff import LLM, LoRARequest, SamplingParams

_lora = import_test_file("model/test_lora.py")
MODEL = "tiny"
PROMPT = [5, 17, 42, 99, 7, 3]
STEPS = 4


@pytest.fixture(scope="module")
def loras(tiny, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("server_loras")
    # the first one on the experts' tensors too
    return [_lora.make_adapter(tiny, str(root / f"a{i}"), seed=20 + i, r=4, target_parameters=_lora.EXPERTS if i == 0 else None)
            for i in range(3)]


server = serve(
    lambda request: request.getfixturevalue("tiny"), "--served-model-name", MODEL, "--max-denoising-steps", str(STEPS),
    "--max-model-len", "256", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
    "--lora-modules", lambda request: f"one={request.getfixturevalue('loras')[0]}",
    lambda request: '{"name": "two", "path": "%s"}' % request.getfixturevalue("loras")[1],
    "--lora-modules-dir", lambda request: os.path.dirname(request.getfixturevalue("loras")[2]),
    env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(client, model: str) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, seed=3,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].token_ids


@pytest.fixture(scope="module")
def offline(tiny, loras):
    """What each model gives the prompt offline (the same engine, alone)."""
    params = SamplingParams(max_tokens=16, seed=3, ignore_eos=True, max_denoising_steps=STEPS)
    out = {}
    # the server's pool size: the adapters' products reduce over every slot's rank columns, and on
    # AVX2's sgemm a 4-column reduction rounds otherwise than an 8-column one
    with LLM(tiny, enable_lora=True, max_lora_rank=8, max_loras=2) as llm:
        for name, lora in [(MODEL, None), ("one", LoRARequest("one", 1, loras[0])), ("two", LoRARequest("two", 2, loras[1])),
                           ("three", LoRARequest("three", 3, loras[2]))]:
            out[name] = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    return out


def test_models_lists_the_adapters(client, loras):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {MODEL, "one", "two"}
    # the adapter's directory by its name, as the checkpoint's: not the server's path to it
    assert cards["one"].parent == MODEL and cards["one"].root == os.path.basename(loras[0])
    assert getattr(cards[MODEL], "parent", None) is None


def test_two_adapters_and_the_base_concurrently(client, offline):
    names = [MODEL, "one", "two"] * 2
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda m: _complete(client, m), names))
    for name, tokens in zip(names, got):
        assert tokens == offline[name], name
    assert offline["one"] != offline[MODEL] != offline["two"]


def test_unknown_adapter_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "nope")
    assert e.value.body["code"] == "model_not_found"


def test_unknown_model_404_names_every_adapter_served(server, client, loras):
    """After a runtime unload, the 404 of an unknown model lists the base model and the adapters still
    served: those of --lora-modules and those loaded at runtime."""
    url = server.url + "/v1"
    for name in ("five", "six"):
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": loras[2]})
        assert r.status_code == 200, r.text
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "five"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as e:
        _complete(client, "five")
    assert e.value.body["message"] == "model 'five' does not exist; this server serves ['tiny', 'one', 'two', 'six']"
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "six"}).status_code == 200


def test_load_and_unload_at_runtime(server, client, loras, offline):
    url = server.url + "/v1"
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "three", "lora_path": loras[2]})
    assert r.status_code == 200, r.text
    assert httpx.post(url + "/load_lora_adapter", json={"lora_name": "three", "lora_path": loras[2]}).status_code == 400
    assert "three" in {m.id for m in client.models.list().data}
    assert _complete(client, "three") == offline["three"]
    # three adapters over two slots: they take turns, none fails
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda m: _complete(client, m), ["one", "two", "three"]))
    assert got == [offline["one"], offline["two"], offline["three"]]
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "three"}).status_code == 200
    assert "three" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(client, "three")
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "three"}).status_code == 404
    bad = httpx.post(url + "/load_lora_adapter", json={"lora_name": "bad", "lora_path": "nonexistent"})
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]  # under the root
    bad = httpx.post(url + "/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "under the server's --lora-modules-dir" in bad.json()["error"]["message"]


def test_lora_requests_info_metric(server, client):
    _complete(client, "one")
    [info] = [s for s in server.metrics().samples if s.name == "vllm:lora_requests_info"]
    assert info.labels["max_lora"] == "2"
    assert set(info.labels) >= {"running_lora_adapters", "waiting_lora_adapters"}
