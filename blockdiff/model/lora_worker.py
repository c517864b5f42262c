"""The worker's side of LoRA (vLLM's WorkerLoRAManager): the model's layers replaced by their LoRA
layers (model/lora_layers.py), adapters read into host memory and written into the pools' slots as
the engine's plans say, which adapter slot each request slot runs with, and the one mapping the
model runner sets before each forward (model/interface.py StepAdapters)."""

from __future__ import annotations

import torch
from torch import nn

from blockdiff.model.attention import AttentionMetadata
from blockdiff.model.lora import AdapterCache, Fingerprint, LoRAError, put_adapter
from blockdiff.model.lora_layers import enable_lora


class WorkerLoRA:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int, rows: int,
                 device: torch.device):
        """Replaces `model`'s adapter-capable layers (pools of `max_loras` adapters of rank <=
        `max_rank`); keeps `max_cpu_loras` adapters read in host memory; `rows`: the request slots
        and the scratch slot."""
        self.model = model
        self.mapping = enable_lora(model, max_loras, max_rank)
        self.cache = AdapterCache(max_cpu_loras, max_rank)
        # each request slot's adapter slot (-1: none), read per token in the static step
        self.table = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.host = [-1] * rows  # the same on the host: a step whose rows have none sets no mapping
        self.expert_slots: set[int] = set()  # the adapter slots whose adapter targets the experts

    def load(self, loads: dict[int, tuple[str, Fingerprint]]) -> None:
        """Writes each adapter (path, fingerprint) into its pool slot."""
        for slot, (path, fingerprint) in loads.items():
            try:
                adapter = self.cache.get(path, fingerprint)
                put_adapter(self.model, slot, adapter)
            except LoRAError:  # left empty: no request runs on the slot's old weights (the engine forgets it)
                put_adapter(self.model, slot, None)
                self.expert_slots.discard(slot)
                raise
            (self.expert_slots.add if adapter.experts else self.expert_slots.discard)(slot)

    def admit(self, slots: list[int], adapters: list[int] | None) -> None:
        """New requests at `slots` run with the adapter slots `adapters` (None: none has one)."""
        adapters = adapters if adapters is not None else [-1] * len(slots)
        for slot, adapter in zip(slots, adapters):
            self.host[slot] = adapter
        index = torch.tensor(slots, dtype=torch.long, device=self.table.device)
        self.table.index_copy_(0, index, torch.tensor(adapters, dtype=torch.long, device=self.table.device))

    def level(self, rows) -> int:
        """How the rows (of a plan, or attention Rows) run LoRA: 0 no row has an adapter, 1 some
        have, 2 one of them targets the experts too (whose pools then run)."""
        held = {self.host[r.slot] for r in rows} - {-1}
        return 0 if not held else 2 if held & self.expert_slots else 1

    def set(self, index: torch.Tensor | None, meta: AttentionMetadata, experts: bool = False) -> None:
        """The mapping of the next forward (LoRAMapping.set)."""
        self.mapping.set(index, meta, experts)

    def set_rows(self, rows, meta: AttentionMetadata) -> None:
        """The mapping of a forward over the plan's `rows` (packed in order, each `length` tokens)."""
        level = self.level(rows)
        index = None
        if level:  # from the host's copy: one upload, no device read (a repeat by device lengths would sync)
            adapters = torch.tensor([self.host[r.slot] for r in rows], dtype=torch.long)
            index = adapters.repeat_interleave(torch.tensor([r.length for r in rows], dtype=torch.long))
            index = index.to(self.table.device)
            if meta.active is not None:  # a fast step runs its encoder tokens and its unsettled decoder rows
                ne = meta.num_encoder_tokens
                index = torch.cat((index[:ne], index[ne:].index_select(0, meta.active.index)))
        self.mapping.set(index, meta, level == 2)
