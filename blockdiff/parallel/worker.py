"""The tensor-parallel executor: the model split over N processes, driven by the engine as rank 0.

Every rank loads only its slices of the checkpoint and builds a `ModelRunner` on its own device.
Each step, rank 0 sends the `StepPlan` to the workers and runs it itself; the collectives inside
the model and the sampler keep the ranks in step, and rank 0's `StepOutput` is the result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdiff.config import ModelConfig
from blockdiff.engine.kv_cache import CacheConfig
from blockdiff.engine.model_runner import ModelRunner, StepOutput, StepPlan
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.loader import load_model
from blockdiff.parallel.group import CommCounter, TPGroup
from blockdiff.parallel.ranks import RankContext, RankProcesses


class TPExecutor:
    def __init__(self, cfg, config: ModelConfig, dtype: torch.dtype, device: str, cache_config: Callable):
        check_splittable(config, cfg.tensor_parallel_size)
        self.ranks = RankProcesses(cfg.tensor_parallel_size, device)
        try:
            self.ranks.run(_load, cfg.model, config, dtype, gather=True)
            # Sized once on rank 0 and sent to all: every rank holds the same number of KV heads.
            self.cache_config: CacheConfig = cache_config(self.ranks.context.state["model"])
            self.ranks.run(_start_runner, self.cache_config, gather=True)
        except BaseException:
            self.ranks.close(abort=True)
            raise
        self.last_step_comm = CommCounter()

    def execute(self, plan: StepPlan) -> StepOutput | None:
        counter = self.ranks.context.group.counter
        counter.reset()
        out = self.ranks.run(_execute, plan)
        self.last_step_comm = CommCounter(counter.bytes, counter.calls)
        return out

    def shutdown(self) -> None:
        self.ranks.close()


def check_splittable(config: ModelConfig, size: int) -> None:
    """Raise ValueError before any process starts if the model cannot be split over `size` ranks:
    rank 0's model is built on the meta device, which runs every layer's own split rules."""
    try:
        with torch.device("meta"):
            DiffusionGemma(config, group=TPGroup(rank=0, size=size), dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size={size}: {e}") from e


def _load(ctx: RankContext, path: str, config: ModelConfig, dtype: torch.dtype) -> None:
    ctx.state["model"] = load_model(path, dtype=dtype, device=ctx.device, group=ctx.group, config=config)


def _start_runner(ctx: RankContext, cache: CacheConfig) -> None:
    ctx.state["runner"] = ModelRunner(ctx.state["model"], cache, ctx.device)


def _execute(ctx: RankContext, plan: StepPlan) -> StepOutput | None:
    return ctx.state["runner"].execute(plan)
