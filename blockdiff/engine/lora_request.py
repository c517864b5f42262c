"""What a request names to run with a LoRA adapter: vLLM's LoRARequest, and vLLM's --lora-modules."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: a LoRA adapter in PEFT's format (a directory with adapter_config.json and
    adapter_model.safetensors) that a request runs with (docs/lora.md). The engine's requests carry
    it as their adapter (inputs.py Adapter)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not self.lora_path:
            raise ValueError("LoRARequest needs lora_path, the adapter's directory")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    @property
    def key(self) -> tuple:
        """Who the adapter is: requests of equal keys share a device slot and cached prefixes (its
        kind first: the prefix cache's root key hashes it)."""
        return ("lora", self.lora_name, self.lora_int_id, self.lora_path)

    @property
    def name(self) -> str:
        return self.lora_name


def lora_modules(values) -> list[LoRARequest]:
    """vLLM's --lora-modules: each `name=path`, or JSON {"name", "path", "base_model_name"}; ids from 1."""
    out = []
    for i, text in enumerate(values or (), 1):
        text = text.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {text!r}: not a JSON object with name and path") from None
            out.append(LoRARequest(name, i, path, spec.get("base_model_name")))
        else:
            name, eq, path = text.partition("=")
            if not (name and eq and path):
                raise ValueError(f"--lora-modules {text!r}: use name=path or JSON")
            out.append(LoRARequest(name, i, path))
    if len({lo.lora_name for lo in out}) != len(out):
        raise ValueError("--lora-modules names an adapter twice")
    return out
