"""The engine's side of --enable-lora (docs/lora.md): which adapters the server knows by name, and
which one each of the workers' `max_loras` device slots holds.

A request naming an adapter is admitted only when its adapter holds a slot or a slot can take it:
an empty one, else the least recently used one that no running request uses; a request whose
adapter finds no slot waits like one the cache cannot hold yet (engine/scheduler.py), it is not
failed. A slot that takes a new adapter is written on every rank before the step that first uses it
(`StepPlan.adapter_loads`); each rank reads the adapter's files itself (its own shard of A and B) and
keeps the `max_cpu_loras` most recently used read in host memory (model/lora.py AdapterCache). An
adapter is its files as a request first found them (their fingerprint): files changed since are
refused when a request names it, and a rank that reads them again checks them against it.
"""

from __future__ import annotations

from collections import OrderedDict

from blockdiff.engine.request import Request
from blockdiff.engine.lora_request import LoRARequest
from blockdiff.model.lora import Fingerprint, LoRAError, check_fits, fingerprint, read_adapter


class LoRASlots:
    def __init__(self, max_loras: int, max_lora_rank: int, model=None):
        """model: the GemmaConfig the adapters must fit (None: not checked here)."""
        self.max_rank, self.model = max_lora_rank, model
        self.held: list[tuple | None] = [None] * max_loras  # each slot's adapter (LoRARequest.key)
        self.refs = [0] * max_loras  # running requests using each slot
        self.recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # least recent first
        self.pending: dict[int, tuple[str, Fingerprint]] = {}  # slot -> (path, fingerprint), written with the next plan
        # Each adapter's identity: the fingerprint of its files when a request first named it. A
        # LoRARequest's key is fixed for as long as it is served (a reload is a new lora_int_id).
        self.identities: dict[tuple, Fingerprint] = {}

    def check(self, lora: LoRARequest) -> None:
        """Reads the adapter the first time it is named (its config and tensors) and checks that it
        fits the model; later, that its files are still those: a size or mtime changed, or (when no
        slot holds it, so that the workers may read it again) a content hash changed. A LoRAError
        names the adapter and what cannot be served."""
        known = self.identities.get(lora.key)
        try:
            if known is None:
                adapter = read_adapter(lora.lora_path, self.max_rank)
                if self.model is not None:
                    check_fits(adapter, self.model)
                self.identities[lora.key] = adapter.fingerprint
            elif not known.stat_matches(lora.lora_path) or (lora.key not in self.held
                                                            and fingerprint(lora.lora_path) != known):
                raise LoRAError("its files changed on disk since it was loaded; load it again "
                                "(/v1/unload_lora_adapter, then /v1/load_lora_adapter)")
        except LoRAError as e:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: {e}") from None

    def available(self, req: Request) -> bool:
        """Whether `req` can be admitted as far as its adapter goes."""
        return req.adapter is None or req.adapter.key in self.held or 0 in self.refs

    def acquire(self, req: Request) -> None:
        """`req` (admitted) takes its adapter's slot, the adapter loaded there if it is not yet."""
        if req.adapter is None:
            req.adapter_slot = -1
            return
        key = req.adapter.key
        if key in self.held:
            slot = self.held.index(key)
        else:
            slot = next(s for s in self.recent if self.refs[s] == 0 and self.held[s] is None) if None in self.held \
                else next(s for s in self.recent if self.refs[s] == 0)
            self.held[slot] = key
            self.pending[slot] = (req.adapter.lora_path, self.identities[key])
        self.refs[slot] += 1
        self.recent.move_to_end(slot)
        req.adapter_slot = slot

    def release(self, req: Request) -> None:
        if req.adapter_slot >= 0:
            self.refs[req.adapter_slot] -= 1
            req.adapter_slot = -1

    def take_loads(self) -> dict[int, tuple[str, Fingerprint]]:
        loads, self.pending = self.pending, {}
        return loads

    def forget(self) -> None:
        """The workers are new, or a step that wrote slots failed (a slot whose load failed is left
        empty): no slot is known to hold an adapter, each is written again when next used."""
        self.held = [None] * len(self.held)
        self.pending.clear()

    def running(self) -> list[str]:
        return [key[0] for s, key in enumerate(self.held) if key is not None and self.refs[s] > 0]
