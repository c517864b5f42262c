"""The adapters the server serves by name (docs/lora.md), and vLLM's runtime loading of more:
POST /v1/load_lora_adapter takes directories under --lora-modules-dir only, at most
--max-runtime-loras of them at once. The operator's --lora-modules may lie anywhere."""

from __future__ import annotations

import asyncio
import os

from blockdiff.entrypoints.openai import errors
from blockdiff.model.lora import LoRAError, read_adapter
from blockdiff.sampling_params import LoRARequest

MAX_NAME_CHARS = 256  # a runtime adapter's name: /v1/models lists every one


class LoRAAdapters:
    def __init__(self, static: list[LoRARequest], reserved: list[str], root: str | None, max_runtime: int,
                 max_rank: int):
        """static: --lora-modules; reserved: the served model's names; root: --lora-modules-dir (None:
        no runtime loading); max_runtime: --max-runtime-loras."""
        self.by_name: dict[str, LoRARequest] = {lo.lora_name: lo for lo in static}  # what requests name
        self.reserved, self.max_runtime, self.max_rank = set(reserved), max_runtime, max_rank
        self.root = None if root is None else os.path.realpath(root)
        self.runtime: set[str] = set()  # names loaded at runtime (those the cap counts)
        self.last_id = max((lo.lora_int_id for lo in static), default=0)

    async def load(self, name: str, given: str) -> None:
        """vLLM's load_lora_adapter: the adapter at `given` (under the root, absolute or relative to
        it) served under `name` from now on; an APIError says why not."""
        self._may_add(name)
        path = self._under_root(given)
        try:
            await asyncio.to_thread(read_adapter, path, self.max_rank)
        except LoRAError as e:
            raise errors.APIError(400, f"LoRA adapter {name!r}: {e}", param="lora_path") from None
        self._may_add(name)  # again: another load may have taken the name or the last place meanwhile
        self.last_id += 1
        self.by_name[name] = LoRARequest(name, self.last_id, path)
        self.runtime.add(name)

    def unload(self, name: str) -> None:
        if self.by_name.pop(name, None) is None:
            raise errors.APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                                  code="model_not_found")
        self.runtime.discard(name)

    def _may_add(self, name: str) -> None:
        if name in self.by_name or name in self.reserved:
            raise errors.APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if len(name) > MAX_NAME_CHARS:
            raise errors.APIError(400, f"lora_name is longer than {MAX_NAME_CHARS} characters", param="lora_name")
        if self.root is None:
            raise errors.APIError(400, "loading adapters at runtime is off: start the server with --lora-modules-dir "
                                       "DIR to allow the adapter directories under DIR", param="lora_path")
        if len(self.runtime) >= self.max_runtime:
            raise errors.APIError(400, f"{self.max_runtime} adapters are loaded at runtime already, the most "
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
            raise errors.APIError(400, "lora_path must name a directory under the server's --lora-modules-dir",
                                  param="lora_path")
        return real
