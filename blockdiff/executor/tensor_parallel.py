"""The tensor-parallel executor: the model split over N processes, driven by the engine as rank 0.

Every rank loads only its slices of the checkpoint and builds a `ModelRunner` on its own device.
Each step, rank 0 sends the `StepPlan` to the workers and runs it itself; the collectives inside
the model and the sampler keep the ranks in step, and rank 0's `StepOutput` is the result.
"""

from __future__ import annotations

import torch

from blockdiff.config import EngineConfig, ModelConfig
from blockdiff.model.loader import load_model
from blockdiff.model.registry import model_class
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext, RankProcesses
from blockdiff.step import CacheConfig, StepOutput, StepPlan
from blockdiff.worker.kv_cache import size_cache
from blockdiff.worker.model_runner import ModelRunner


class TPExecutor:
    def __init__(self, cfg: EngineConfig, config: ModelConfig, dtype: torch.dtype, device: str, max_model_len: int):
        check_splittable(config, cfg.tensor_parallel_size)
        self.ranks = RankProcesses(cfg.tensor_parallel_size, device)
        try:
            self.ranks.run(_load, cfg.model, config, dtype, gather=True)
            # Sized once on rank 0 and sent to all: every rank holds the same number of KV heads.
            self.cache_config: CacheConfig = size_cache(self.ranks.context.state["model"], cfg, max_model_len)
            self.ranks.run(_start_runner, self.cache_config, cfg.tune_cpu_heap, gather=True)
        except BaseException:
            self.ranks.close(abort=True)
            raise

    def execute(self, plan: StepPlan) -> StepOutput | None:
        return self.ranks.run(_execute, plan)

    def shutdown(self) -> None:
        self.ranks.close()


def check_splittable(config: ModelConfig, size: int) -> None:
    """Raise ValueError before any process starts if the model cannot be split over `size` ranks:
    rank 0's model is built on the meta device, which runs every layer's own split rules."""
    try:
        with torch.device("meta"):
            model_class(config)(config, group=TPGroup(rank=0, size=size), dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size={size}: {e}") from e


def _load(ctx: RankContext, path: str, config: ModelConfig, dtype: torch.dtype) -> None:
    ctx.state["model"] = load_model(path, dtype=dtype, device=ctx.device, group=ctx.group, config=config)


def _start_runner(ctx: RankContext, cache: CacheConfig, tune_cpu_heap: bool) -> None:
    ctx.state["runner"] = ModelRunner(ctx.state["model"], cache, ctx.device, tune_cpu_heap)


def _execute(ctx: RankContext, plan: StepPlan) -> StepOutput | None:
    return ctx.state["runner"].execute(plan)
