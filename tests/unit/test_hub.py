"""Models named by Hugging Face id load from the local Hugging Face cache: a temporary cache in the
hub's layout (models--org--name/snapshots/<commit>/..., refs/main) holding a tiny checkpoint is
served by id through a real server, and by LLM(model=id)."""

from __future__ import annotations

import os
import shutil

import openai
import pytest
from server_process import ServerProcess

from blockdiff import LLM, SamplingParams
from blockdiff.hub import resolve_model

REPO = "tiny-org/tiny-diffusiongemma"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_cache(tiny, tmp_path_factory) -> str:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(tiny, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return str(cache)


def test_resolve_reads_hf_hub_cache_and_download_dir(hf_cache, monkeypatch):
    snapshot = os.path.join(hf_cache, "models--tiny-org--tiny-diffusiongemma", "snapshots", COMMIT)
    assert resolve_model(REPO, download_dir=hf_cache) == snapshot
    with pytest.raises(ValueError, match=f"hf download {REPO} --cache-dir /nowhere"):
        resolve_model(REPO, download_dir="/nowhere")
    with pytest.raises(ValueError, match="nor a Hugging Face id"):
        resolve_model("no/such/dir")


def test_llm_takes_a_cached_hub_id(hf_cache, tiny):
    params = SamplingParams(max_tokens=8, max_denoising_steps=2, seed=3)
    with LLM(REPO, download_dir=hf_cache) as by_id:
        got = by_id.generate("Hello", params)[0].token_ids
    with LLM(tiny) as by_path:
        assert got == by_path.generate("Hello", params)[0].token_ids


def test_serve_by_hub_id_from_the_cache(hf_cache, tmp_path, monkeypatch):
    # HF_HUB_CACHE is read by the server process (no --download-dir); offline, so nothing is fetched.
    monkeypatch.setenv("HF_HUB_CACHE", hf_cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = ServerProcess(REPO, "--max-denoising-steps", "2", log_path=str(tmp_path / "server.log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [REPO]
        r = client.completions.create(model=REPO, prompt="Hello", max_tokens=8, seed=0)
        assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")
        snapshot = os.path.join(hf_cache, "models--tiny-org--tiny-diffusiongemma", "snapshots", COMMIT)
        log = server.log()
        assert f"serving {snapshot} as ['{REPO}'] on {server.url}" in log
        # The startup summary, before it: model, dtype, device, TP, threads and why, the limits.
        summary = log[:log.index("serving ")]
        for expected in [f"model {snapshot}: float32 on cpu, tensor parallel size 1", "threads: 1 (OMP_NUM_THREADS=1)",
                         "max_model_len ", "max_num_seqs 16, KV cache ", " tokens"]:
            assert expected in summary, expected
    finally:
        server.close()
