"""The way one request's `seed` and `max_denoising_steps` take from the HTTP body to the step's
tensors, followed in a real in-process server (the app over AsyncEngine over LLMEngine): every
function of blockdiff that is called with the value, or with an object that carries it (in its
fields, items or elements, a few levels deep: the body's bytes, the API request, SamplingParams,
the EngineRequest, the Request, the plan, the sampler's StepParams tensors), in every thread, up
to the call of the sampler's step with the StepParams that hold it. A method's own object is not
counted as handed to it. The files of those calls, in order, are the value's path."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import httpx
import pytest
import torch

import blockdiff
from blockdiff.config import EngineConfig
from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.engine.engine import LLMEngine
from blockdiff.entrypoints.openai.config import ServerConfig
from blockdiff.entrypoints.openai.server import build_app

ROOT = os.path.dirname(blockdiff.__file__) + os.sep
SEED = 918_273_645  # below 2**32: its low word, which the step's seed tensor holds, is itself
STEPS = 13
_DEPTH = 4
_ITEMS = 16


def _carries(obj, name: str, value: int, depth: int = _DEPTH) -> bool:
    """Whether `obj` is `value` under `name`, or holds it (a field or key `name` equal to it, a
    tensor field `name` holding it, the JSON text `"name":value`), `depth` levels down at most."""
    if isinstance(obj, (bytes, str)):
        text = obj if isinstance(obj, str) else obj.decode("latin-1")
        return len(text) < 1 << 16 and f'"{name}":{value}' in text
    if depth == 0 or isinstance(obj, (int, float, bool, type(None), torch.Tensor)):
        return False
    if isinstance(obj, dict):
        fields = obj
    elif isinstance(obj, (list, tuple)):
        return any(_carries(x, name, value, depth - 1) for x in obj[:_ITEMS])
    else:
        fields = getattr(obj, "__dict__", None)
        if not isinstance(fields, dict) or isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith(
                ("asyncio", "threading", "concurrent", "starlette", "fastapi", "httpx", "socket")):
            return False
    many = fields.get(name + "s")  # a list of one value per request (NewRequests.seeds)
    if isinstance(many, list) and value in many[:_ITEMS] and not isinstance(value, bool):
        return True
    mine = fields.get(name) if name in fields else None
    if isinstance(mine, torch.Tensor):
        if mine.numel() and mine.numel() < 1 << 12 and bool((mine == value).any()):
            return True
    elif mine == value and not isinstance(mine, bool) and mine is not None:
        return True
    return any(_carries(v, name, value, depth - 1) for k, v in list(fields.items())[:_ITEMS * 4] if k != name)


class _Follower:
    """The blockdiff files (relative to the package) of the calls that handle each value, in order,
    each run of calls within one file counted once, up to the sampler step that reads it."""

    def __init__(self, values: dict[str, int]):
        self.values = values
        self.paths: dict[str, list[str]] = {name: [] for name in values}
        self.done: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, frame, event, arg):
        if event != "call" or len(self.done) == len(self.values):
            return
        file = frame.f_code.co_filename
        if not file.startswith(ROOT):
            return
        code = frame.f_code
        args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        handed = [frame.f_locals[a] for a in args if a not in ("self", "cls") and a in frame.f_locals]
        for name, value in self.values.items():
            if name in self.done:
                continue
            named = frame.f_locals.get(name)
            if not (name in args and named.__class__ is int and named == value) and not any(
                    _carries(a, name, value) for a in handed):
                continue
            with self.lock:
                path, here = self.paths[name], file[len(ROOT):]
                if not path or path[-1] != here:
                    path.append(here)
                # The step's tensors: the sampler's step called with the StepParams that hold the value.
                if code.co_name == "step" and isinstance(frame.f_locals.get("logits"), torch.Tensor):
                    self.done.add(name)


@pytest.fixture(scope="module")
def paths(checkpoints) -> dict[str, list[str]]:
    """Each value's path through one completion request, in one real in-process server."""
    tiny = checkpoints("default", vocab_size=301, canvas_length=8, sliding_window=6, seed=1)
    engine = LLMEngine(EngineConfig(tiny, max_model_len=64, max_num_seqs=2, async_scheduling=False))
    app = build_app(AsyncEngine(engine), ServerConfig(["tiny"]))
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 8, "seed": SEED, "max_denoising_steps": STEPS},
                      separators=(",", ":"))
    follow = _Follower({"seed": SEED, "max_denoising_steps": STEPS})

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://server", timeout=60) as client:
                threading.setprofile(follow)
                sys.setprofile(follow)
                try:
                    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                finally:
                    sys.setprofile(None)
                    threading.setprofile(None)
                assert r.status_code == 200, r.text

    asyncio.run(main())
    assert follow.done == set(follow.values), follow.paths  # each value reached the step's tensors
    for name, path in follow.paths.items():
        print(f"{name} ({len(path)} files entered, {len(set(path))} distinct): {' -> '.join(path)}")
    return follow.paths


@pytest.mark.parametrize("name", ["seed", "max_denoising_steps"])
def test_the_engine_carries_the_sampler_parameters_the_edge_resolved(paths, name):
    """The sampler (diffusion/) is entered at the edge, which resolves the value, and on the worker,
    which makes it the step's tensors; not by the engine in between, which carries it as it is."""
    path = paths[name]
    engine = path.index("engine/async_engine.py")  # the edge hands the request to the engine
    worker = next(i for i, f in enumerate(path) if f.startswith("worker/"))
    assert any(f.startswith("diffusion/") for f in path[:engine]), path
    assert not [f for f in path[engine:worker] if f.startswith("diffusion/")], path


@pytest.mark.xfail(strict=True, reason="the edge (body, protocol, serving, the request builder) and the engine "
                                       "(scheduler, KV-cache manager, output processor) still hand the request "
                                       "back and forth: 58 files entered, 27 of them distinct")
@pytest.mark.parametrize("name", ["seed", "max_denoising_steps"])
def test_the_value_crosses_at_most_ten_files_none_twice(paths, name):
    path = paths[name]
    assert len(path) <= 10 and len(set(path)) == len(path), path
