"""Where the model runs: in this process (one device) or on a tensor-parallel group of processes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdiff.config import ModelConfig
from blockdiff.engine.kv_cache import CacheConfig
from blockdiff.engine.model_runner import ModelRunner, StepOutput, StepPlan
from blockdiff.model.loader import load_model
from blockdiff.parallel.group import TPGroup


class LocalExecutor:
    def __init__(self, model_dir: str, config: ModelConfig, dtype: torch.dtype, device: str, cache_config: Callable):
        model = load_model(model_dir, dtype=dtype, device=device, group=TPGroup(), config=config)
        self.cache_config: CacheConfig = cache_config(model)
        self.runner = ModelRunner(model, self.cache_config, device)

    def execute(self, plan: StepPlan) -> StepOutput | None:
        return self.runner.execute(plan)

    def heartbeat(self, timeout: float) -> None:
        """One process: nothing can be lost without the engine noticing."""

    def shutdown(self) -> None:
        pass


def make_executor(cfg, config: ModelConfig, dtype: torch.dtype, device: str, cache_config: Callable):
    if cfg.tensor_parallel_size == 1:
        return LocalExecutor(cfg.model, config, dtype, device, cache_config)
    from blockdiff.parallel.worker import TPExecutor

    return TPExecutor(cfg, config, dtype, device, cache_config)
