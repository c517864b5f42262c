"""The adapters the server serves by name (docs/lora.md), and vLLM's runtime loading of more:
POST /v1/load_lora_adapter takes directories under --lora-modules-dir only, at most
--max-runtime-loras of them at once. The operator's --lora-modules may lie anywhere. Also vLLM's
vllm:lora_requests_info, read from the engines' stats."""

from __future__ import annotations

import asyncio
import os
import time

from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import Collector

from blockdiff.config import EngineConfig
from blockdiff.engine.client import EngineClient, EngineStats
from blockdiff.engine.lora_request import LoRARequest, lora_modules
from blockdiff.model.lora import LoRAError, read_adapter

MAX_NAME_CHARS = 256  # a runtime adapter's name: /v1/models lists every one


class AdapterRefused(ValueError):
    """A load or unload the server refuses: the HTTP status, and the body's param and code."""

    def __init__(self, status: int, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def served_adapters(cfg: EngineConfig, served_model_names: list[str], runtime_updating: bool) -> "LoRAAdapters":
    """The adapters a server of `cfg` (--enable-lora) serves from startup, each checked (a broken one
    fails the start, naming what is wrong); `runtime_updating`: whether the load and unload
    endpoints exist (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, or --lora-modules-dir given)."""
    if cfg.lora_modules_dir is not None and not os.path.isdir(cfg.lora_modules_dir):
        raise ValueError(f"--lora-modules-dir {cfg.lora_modules_dir!r} is not a directory")
    static = lora_modules(cfg.lora_modules)
    for lo in static:
        try:
            read_adapter(lo.lora_path, cfg.max_lora_rank)
        except LoRAError as e:
            raise LoRAError(f"--lora-modules {lo.lora_name}={lo.lora_path}: {e}") from None
    return LoRAAdapters(static, served_model_names, cfg.lora_modules_dir, cfg.max_runtime_loras, cfg.max_lora_rank,
                        runtime_updating or cfg.lora_modules_dir is not None)


class LoRAAdapters:
    def __init__(self, static: list[LoRARequest], reserved: list[str], root: str | None, max_runtime: int,
                 max_rank: int, runtime_updating: bool = False):
        """static: --lora-modules; reserved: the served model's names; root: --lora-modules-dir (None:
        no runtime loading); max_runtime: --max-runtime-loras; runtime_updating: whether the load
        and unload endpoints exist."""
        self.runtime_updating = runtime_updating
        self.by_name: dict[str, LoRARequest] = {lo.lora_name: lo for lo in static}  # what requests name
        self.reserved, self.max_runtime, self.max_rank = set(reserved), max_runtime, max_rank
        self.root = None if root is None else os.path.realpath(root)
        self.runtime: set[str] = set()  # names loaded at runtime (those the cap counts)
        self.last_id = max((lo.lora_int_id for lo in static), default=0)

    async def load(self, name: str, given: str) -> None:
        """vLLM's load_lora_adapter: the adapter at `given` (under the root, absolute or relative to
        it) served under `name` from now on; an AdapterRefused says why not."""
        self._may_add(name)
        path = self._under_root(given)
        try:
            await asyncio.to_thread(read_adapter, path, self.max_rank)
        except LoRAError as e:
            raise AdapterRefused(400, f"LoRA adapter {name!r}: {e}", param="lora_path") from None
        self._may_add(name)  # again: another load may have taken the name or the last place meanwhile
        self.last_id += 1
        self.by_name[name] = LoRARequest(name, self.last_id, path)
        self.runtime.add(name)

    def unload(self, name: str) -> None:
        if self.by_name.pop(name, None) is None:
            raise AdapterRefused(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                                  code="model_not_found")
        self.runtime.discard(name)

    def _may_add(self, name: str) -> None:
        if name in self.by_name or name in self.reserved:
            raise AdapterRefused(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if len(name) > MAX_NAME_CHARS:
            raise AdapterRefused(400, f"lora_name is longer than {MAX_NAME_CHARS} characters", param="lora_name")
        if self.root is None:
            raise AdapterRefused(400, "loading adapters at runtime is off: start the server with --lora-modules-dir "
                                       "DIR to allow the adapter directories under DIR", param="lora_path")
        if len(self.runtime) >= self.max_runtime:
            raise AdapterRefused(400, f"{self.max_runtime} adapters are loaded at runtime already, the most "
                                       "--max-runtime-loras allows: unload one first", param="lora_name")

    def _under_root(self, given: str) -> str:
        """The real directory `given` names (symlinks and `..` resolved), under the root. One message
        for every path elsewhere: it says nothing of what exists there."""
        try:
            real = os.path.realpath(os.path.join(self.root, given))
            inside = os.path.commonpath([self.root, real]) == self.root
        except ValueError:  # a NUL byte
            inside = False
        if not inside:
            raise AdapterRefused(400, "lora_path must name a directory under the server's --lora-modules-dir",
                                  param="lora_path")
        return real


class LoRAInfo(Collector):
    """vLLM's vllm:lora_requests_info, of the engines behind `client` (none where LoRA is off)."""

    def __init__(self, client: EngineClient):
        self.client = client

    def collect(self):
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests (vLLM's: the adapters "
                                   "of running and waiting requests in its labels; the value is the time).",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        stats = list(self.client.engine_stats().values())
        total = EngineStats.total(stats) if stats else None
        if total is not None and total.adapter_slots:
            family.add_metric([str(total.adapter_slots), ",".join(total.waiting_adapters),
                               ",".join(total.running_adapters)], time.time())
        return [family] if family.samples else []
