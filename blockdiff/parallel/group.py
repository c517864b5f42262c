"""The tensor-parallel group: rank, size, and the few collectives the model needs.

A `TPGroup` of size 1 is a plain value with no process group behind it; layers ask `group.size`
once at construction and build their single-device form, so one device never reaches a collective.
Every collective counts the bytes it moves, so tests and benchmarks can see what a step costs.

Groups are built from a private `TCPStore` (`connect`) and call their c10d backend directly, so
blockdiff never touches torch.distributed's global default group: a program may hold several
engines, or run blockdiff inside its own torch.distributed job.

Under torch.compile the collectives are torch's functional collectives (`_functional_collectives`),
which dynamo traces into the graph; the backend's own calls are opaque to it ("Unsupported method
call"). The group is registered under a name of its own for them (docs/tp.md, "Compiled steps").
Eager steps keep the backend's in-place calls, which the counter counts; compiled ones are not counted.
"""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group


@dataclass
class CommCounter:
    bytes: int = 0
    calls: int = 0

    def add(self, t: torch.Tensor, factor: int = 1) -> None:
        self.bytes += t.numel() * t.element_size() * factor
        self.calls += 1

    def reset(self) -> None:
        self.bytes = 0
        self.calls = 0


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    backend: object = None  # a c10d Backend: ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA
    counter: CommCounter = field(default_factory=CommCounter)
    process_group: object = None  # the backend as a registered ProcessGroup, for functional collectives

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place on a contiguous tensor; returns it."""
        if torch.compiler.is_compiling():
            return t.copy_(funcol.all_reduce(t, op, self.process_group))
        self.counter.add(t)
        self.backend.allreduce([t], _OPS[op]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[*] on every rank -> [size, *], rank order."""
        if torch.compiler.is_compiling():
            return funcol.all_gather_tensor(t.contiguous().view(-1), 0, self.process_group).view(self.size, *t.shape)
        flat = torch.empty(self.size * t.numel(), dtype=t.dtype, device=t.device)
        self.counter.add(t, self.size)
        self.backend._allgather_base(flat, t.contiguous().view(-1)).wait()
        return flat.view(self.size, *t.shape)

    def shutdown(self, abort: bool = False) -> None:
        """Release the group; `abort` when ranks may be stuck in a collective."""
        if self.backend is not None:
            self.backend.abort() if abort else self.backend.shutdown()
            self.backend = None
        if self.process_group is not None:
            _unregister_process_group(self.process_group.group_name)
            self.process_group = None


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

def connect(rank: int, size: int, store: dist.Store, device: torch.device, timeout: datetime.timedelta) -> TPGroup:
    """Join the group of `size` ranks that meet at `store`: gloo for CPU tensors, NCCL for CUDA.
    Blocks until every rank has called it."""
    prefixed = dist.PrefixStore("blockdiff_tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        backend._set_sequence_number_for_group()
        # Create the communicator now rather than inside the first step's collective.
        backend.eager_connect_single_device(device)
    elif device.type == "cpu":
        backend = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    else:
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, not {device.type!r}")
    return TPGroup(rank=rank, size=size, backend=backend, process_group=_register(prefixed, rank, size, device, backend))


_names = itertools.count()


def _register(store: dist.Store, rank: int, size: int, device: torch.device, backend) -> dist.ProcessGroup:
    """The backend as a ProcessGroup registered under a name of this process's own, which functional
    collectives look up (torch.distributed's global state is left alone). The registry holds it
    weakly: the group keeps it alive."""
    name = f"blockdiff_tp_{os.getpid()}_{next(_names)}"
    kind = dist.ProcessGroup.BackendType.NCCL if device.type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    pg = dist.ProcessGroup(store, rank, size)
    pg._set_default_backend(kind)
    pg._register_backend(torch.device(device.type), kind, backend)
    pg._set_group_name(name)
    _register_process_group(name, pg)
    return pg
