"""The tensor-parallel group: rank, size, and the few collectives the model needs.

A `TPGroup` of size 1 is a plain value with no process group behind it; layers ask `group.size`
once at construction and build their single-device form, so one device never reaches a collective.
Every collective counts the bytes it moves, so tests and benchmarks can see what a step costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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
    group: object = None  # torch.distributed process group for tensors (gloo on CPU, NCCL on CUDA)
    counter: CommCounter = field(default_factory=CommCounter)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.counter.add(t)
        dist.all_reduce(t, op=_OPS[op], group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[*] on every rank -> [size, *], rank order."""
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        self.counter.add(t, self.size)
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
        return out


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

SINGLE = TPGroup()
