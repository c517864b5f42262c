"""LoRA lives in its own modules (blockdiff/model/lora*, blockdiff/engine/lora*): outside them only
the files where a user or the runner meets it mention it, and no forward takes an adapter."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil

from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "blockdiff")
LORA_MODULES = ("model/lora", "engine/lora")

# Where LoRA is met outside its modules, each for a reason of its own: its flags (config.py); the
# Python API's LoRARequest and lora_request (__init__.py, llm.py, and LLMEngine.add_request in
# engine/engine.py, which also keeps the adapters' device slots); the HTTP endpoints and the
# adapters served by name (entrypoints/openai/server.py); the runner that swaps the LoRA layers in
# and sets each step's mapping (worker/model_runner.py); vLLM's KV-event fields lora_id and
# lora_name on the wire (engine/kv_events.py).
MENTIONS = {"__init__.py", "config.py", "llm.py", "engine/engine.py", "engine/kv_events.py",
            "entrypoints/openai/server.py", "worker/model_runner.py"}


def lora_files() -> set[str]:
    """`grep -rl -i lora blockdiff` outside the LoRA modules, as paths under blockdiff/."""
    found = set()
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            rel = os.path.relpath(os.path.join(folder, name), PACKAGE).replace(os.sep, "/")
            if rel.startswith(LORA_MODULES):
                continue
            with open(os.path.join(folder, name), "rb") as f:
                if b"lora" in f.read().lower():
                    found.add(rel)
    return found


def test_lora_is_mentioned_only_where_it_is_met():
    assert lora_files() == MENTIONS


def test_no_forward_takes_an_adapter():
    """The model's, the parallel layers' and the worker's step functions: adapters reach the layers
    through the mapping the runner sets, not through arguments."""
    takes = []
    for package in ("blockdiff.model", "blockdiff.parallel"):
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            if info.name.endswith("_triton"):  # Triton kernels: no modules
                continue
            module = importlib.import_module(info.name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, nn.Module) and cls.__module__ == module.__name__:
                    for method in ("forward", "backbone", "run"):
                        if method in cls.__dict__:
                            takes += [f"{cls.__qualname__}.{method}({p})" for p in
                                      inspect.signature(cls.__dict__[method]).parameters if "lora" in p.lower()]
    from blockdiff.worker import canvas_step

    for fn in (canvas_step.canvas_step, canvas_step.forward_step):
        takes += [f"{fn.__name__}({p})" for p in inspect.signature(fn).parameters if "lora" in p.lower()]
    assert not takes
    # the model's interface too
    from blockdiff.model.interface import BlockDiffusionModel

    assert not [p for p in inspect.signature(BlockDiffusionModel.forward).parameters if "lora" in p.lower()]
