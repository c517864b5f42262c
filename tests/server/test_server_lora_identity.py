"""LoRA adapters as hostile clients and changing disks meet them, through the real server
(docs/lora.md, "Adapters and their files"): an adapter is its files as first read, and files
changed since are refused with a 400 naming the adapter (never served with a 200), until it is
loaded again; malformed adapters are 400s without a traceback in the log; runtime loading takes
directories under --lora-modules-dir only, and at most --max-runtime-loras of them."""

from __future__ import annotations

import concurrent.futures
import os
import shutil

import httpx
import pytest
from helpers import import_test_file
from server_process import serve

_lora = import_test_file("model/test_lora.py")
MODEL = "tiny"
PROMPT = [5, 17, 42, 99, 7, 3]
WEIGHTS = _lora.WEIGHTS
MAX_RUNTIME = 4


@pytest.fixture(scope="module")
def sources(tiny, tmp_path_factory) -> list[str]:
    """Three adapters of the tiny model, outside the server's --lora-modules-dir."""
    root = tmp_path_factory.mktemp("lora_sources")
    return [_lora.make_adapter(tiny, str(root / f"s{i}"), seed=50 + i, r=4) for i in range(3)]


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lora_root"))


server = serve(
    lambda request: request.getfixturevalue("tiny"), "--served-model-name", MODEL, "--max-denoising-steps", "4",
    "--max-model-len", "256", "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "8",
    "--lora-modules-dir", lambda request: request.getfixturevalue("lora_root"),
    "--max-runtime-loras", str(MAX_RUNTIME),
)


def _post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _complete(server, model: str) -> httpx.Response:
    return _post(server, "/v1/completions", model=model, prompt=PROMPT, max_tokens=16, seed=3, ignore_eos=True,
                 return_token_ids=True)


def _tokens(server, model: str) -> list[int]:
    r = _complete(server, model)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _load(server, name: str, path: str) -> httpx.Response:
    return _post(server, "/v1/load_lora_adapter", lora_name=name, lora_path=path)


def _unload(server, name: str) -> None:
    assert _post(server, "/v1/unload_lora_adapter", lora_name=name).status_code == 200


def _copy(src: str, root: str, name: str) -> str:
    dst = os.path.join(root, name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def _no_traceback(server) -> None:
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("rewrite", ["wrong_shapes", "truncated", "other_weights", "other_weights_same_stat"])
def test_an_adapter_rewritten_on_disk_is_refused_until_reloaded(server, sources, lora_root, rewrite):
    """`swap` is served, `other` takes the only slot and host copy, `swap`'s files are rewritten:
    `swap` is a 400 naming it (the worker would have to read it again), other clients are served as
    before meanwhile, and loading `swap` again serves its new files (or refuses broken ones)."""
    name = f"swap-{rewrite}"
    swap = _copy(sources[0], lora_root, name)
    assert _load(server, name, swap).status_code == 200
    assert _load(server, "other", _copy(sources[1], lora_root, "other")).status_code == 200
    try:
        want_swap, want_other, want_base = _tokens(server, name), _tokens(server, "other"), _tokens(server, MODEL)
        assert want_swap != want_other != want_base
        weights = os.path.join(swap, WEIGHTS)
        before = os.stat(weights)
        if rewrite == "wrong_shapes":
            _lora.wrong_shapes(swap)
        elif rewrite == "truncated":
            _lora.truncated(swap)
        else:  # valid, of the same shapes: only the numbers differ
            shutil.copyfile(os.path.join(sources[2], WEIGHTS), weights)
            assert os.path.getsize(weights) == before.st_size
            if rewrite == "other_weights_same_stat":  # only the content hash can tell
                os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        for _ in range(2):  # and again: no slot is left poisoned
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                swapped, other, base = pool.map(lambda m: _complete(server, m), [name, "other", MODEL])
            assert swapped.status_code == 400, swapped.text
            message = swapped.json()["error"]["message"]
            assert name in message and "changed on disk" in message and "load it again" in message
            assert other.json()["choices"][0]["token_ids"] == want_other
            assert base.json()["choices"][0]["token_ids"] == want_base
        _unload(server, name)
        if rewrite.startswith("other_weights"):
            assert _load(server, name, swap).status_code == 200  # its new files are its new identity
            assert _load(server, "third", _copy(sources[2], lora_root, "third")).status_code == 200
            try:
                assert _tokens(server, name) == _tokens(server, "third") != want_swap
            finally:
                _unload(server, "third")
        else:
            r = _load(server, name, swap)
            if r.status_code == 200:  # shapes are checked against the model when a request names it
                r = _complete(server, name)
                _unload(server, name)
            assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
            _copy(sources[0], lora_root, name)  # the files put back: served as before once loaded again
            assert _load(server, name, swap).status_code == 200
            assert _tokens(server, name) == want_swap
        assert _tokens(server, "other") == want_other
        _no_traceback(server)
    finally:
        for n in (name, "other"):
            _post(server, "/v1/unload_lora_adapter", lora_name=n)


@pytest.mark.parametrize("damage, reason", [(_lora.truncated, "cannot be read"), (_lora.zero_rank, "rank 0"),
                                            (_lora.huge_header, "cannot be read")])
def test_malformed_adapters_are_400s_without_a_traceback(server, sources, lora_root, damage, reason):
    name = f"bad-{damage.__name__}"
    path = _copy(sources[0], lora_root, name)
    damage(path)
    r = _load(server, name, path)
    assert r.status_code == 400, r.text
    assert name in r.json()["error"]["message"] and reason in r.json()["error"]["message"]
    assert name not in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    _no_traceback(server)


def test_runtime_paths_outside_the_root_reveal_nothing(server, sources, lora_root):
    outside = os.path.dirname(sources[0])
    link = os.path.join(lora_root, "link")
    if not os.path.islink(link):
        os.symlink(sources[0], link)  # inside the root by name, outside it in truth
    paths = [sources[0], outside, "/nonexistent", "/etc", os.path.join(lora_root, "..", os.path.basename(outside), "s0"),
             "../" + os.path.basename(outside), link, "link/../../x", "a\0b"]
    messages = set()
    for path in paths:
        r = _load(server, "escape", path)
        assert r.status_code == 400, (path, r.text)
        messages.add(r.json()["error"]["message"])
    [message] = messages  # one answer, whatever lies there
    assert "--lora-modules-dir" in message and "adapter_config" not in message
    assert "escape" not in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}
    # relative to the root, and absolute under it: both served
    _copy(sources[1], lora_root, "rel")
    assert _load(server, "rel", "rel").status_code == 200
    try:
        assert _tokens(server, "rel")
    finally:
        _unload(server, "rel")


def test_runtime_adapters_are_capped(server, sources, lora_root):
    path = _copy(sources[0], lora_root, "capped")
    loaded = []
    try:
        for i in range(MAX_RUNTIME + 1):
            r = _load(server, f"cap{i}", path)
            if r.status_code != 200:
                break
            loaded.append(f"cap{i}")
        assert len(loaded) == MAX_RUNTIME and r.status_code == 400
        assert "--max-runtime-loras" in r.json()["error"]["message"]
        _unload(server, loaded.pop())
        assert _load(server, "cap-again", path).status_code == 200  # a place freed is a place to load
        loaded.append("cap-again")
    finally:
        for name in loaded:
            _unload(server, name)


vllm_server = serve(
    lambda request: request.getfixturevalue("tiny"), "--served-model-name", MODEL, "--max-model-len", "256",
    "--enable-lora", "--max-lora-rank", "8", "--lora-modules", lambda request: f"one={request.getfixturevalue('sources')[0]}",
    env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
)


def test_without_a_root_runtime_loading_is_off(vllm_server, sources):
    """vLLM's switch alone opens the endpoints, but a load names the flag that allows it: whatever
    the path, one answer (nothing is read); the operator's --lora-modules are served and unloadable."""
    answers = {(r.status_code, r.json()["error"]["message"])
               for r in (_load(vllm_server, "x", path) for path in (sources[1], "/nonexistent"))}
    [(status, message)] = answers
    assert status == 400 and "start the server with --lora-modules-dir" in message
    assert _tokens(vllm_server, "one")
    _unload(vllm_server, "one")
    assert _complete(vllm_server, "one").status_code == 404
