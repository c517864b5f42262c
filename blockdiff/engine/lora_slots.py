"""The engine's side of --enable-lora (docs/lora.md): which adapters the server knows by name, and
which one each of the workers' `max_loras` device slots holds.

A request naming an adapter is admitted only when its adapter holds a slot or a slot can take it:
an empty one, else the least recently used one that no running request uses; a request whose
adapter finds no slot waits like one the cache cannot hold yet (engine/scheduler.py), it is not
failed. A slot that takes a new adapter is written on every rank before the step that first uses it
(`StepPlan.lora_loads`); each rank reads the adapter's files itself (its own shard of A and B) and
keeps the `max_cpu_loras` most recently used read in host memory (model/lora.py AdapterCache).
"""

from __future__ import annotations

from collections import OrderedDict

from blockdiff.engine.request import Request
from blockdiff.model.lora import check_fits, read_adapter
from blockdiff.sampling_params import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int, max_lora_rank: int, model=None):
        """model: the GemmaConfig the adapters must fit (None: not checked here)."""
        self.max_rank, self.model = max_lora_rank, model
        self.held: list[tuple | None] = [None] * max_loras  # each slot's adapter (LoRARequest.key)
        self.refs = [0] * max_loras  # running requests using each slot
        self.recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # least recent first
        self.pending: dict[int, str] = {}  # slot -> path, written with the next plan
        self.checked: set[str] = set()  # adapter directories read once and found servable

    def check(self, lora: LoRARequest) -> None:
        """Reads the adapter once (its config and tensors) and checks that it fits the model: a
        LoRAError names what cannot be served."""
        if lora.lora_path not in self.checked:
            adapter = read_adapter(lora.lora_path, self.max_rank)
            if self.model is not None:
                check_fits(adapter, self.model)
            self.checked.add(lora.lora_path)

    def available(self, req: Request) -> bool:
        """Whether `req` can be admitted as far as its adapter goes."""
        return req.lora is None or req.lora.key in self.held or 0 in self.refs

    def acquire(self, req: Request) -> None:
        """`req` (admitted) takes its adapter's slot, the adapter loaded there if it is not yet."""
        if req.lora is None:
            req.lora_slot = -1
            return
        key = req.lora.key
        if key in self.held:
            slot = self.held.index(key)
        else:
            slot = next(s for s in self.recent if self.refs[s] == 0 and self.held[s] is None) if None in self.held \
                else next(s for s in self.recent if self.refs[s] == 0)
            self.held[slot] = key
            self.pending[slot] = req.lora.lora_path
        self.refs[slot] += 1
        self.recent.move_to_end(slot)
        req.lora_slot = slot

    def release(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.refs[req.lora_slot] -= 1
            req.lora_slot = -1

    def take_loads(self) -> dict[int, str]:
        loads, self.pending = self.pending, {}
        return loads

    def forget(self) -> None:
        """The workers are new: their slots hold nothing."""
        self.held = [None] * len(self.held)
        self.pending.clear()

    def running(self) -> list[str]:
        return [key[0] for s, key in enumerate(self.held) if key is not None and self.refs[s] > 0]
