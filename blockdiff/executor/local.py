"""The executor of one device: the model and its runner in this process."""

from __future__ import annotations

import torch

from blockdiff.config import EngineConfig, ModelConfig
from blockdiff.diffusion.registry import make_sampler
from blockdiff.model.loader import load_model
from blockdiff.parallel.group import TPGroup
from blockdiff.step import CacheConfig, StepOutput, StepPlan
from blockdiff.worker.kv_cache import size_cache
from blockdiff.worker.model_runner import ModelRunner, RunnerSettings


def runner_settings(cfg: EngineConfig, device: str) -> RunnerSettings:
    """What the workers' ModelRunner takes of the engine's configuration on `device`."""
    compile, cuda_graphs = cfg.step_modes(device)
    return RunnerSettings(tune_cpu_heap=cfg.tune_cpu_heap, sampler_memory_gb=cfg.sampler_memory_gb, compile=compile,
                          cuda_graphs=cuda_graphs, steps_per_launch=cfg.steps_per_launch(device),
                          attention_backend=cfg.attention_backend, logprobs_mode=cfg.logprobs_mode,
                          adapters=cfg.adapter_pool())


class LocalExecutor:
    def __init__(self, cfg: EngineConfig, config: ModelConfig, dtype: torch.dtype, device: str, max_model_len: int,
                 sampler: str):
        model = load_model(cfg.model, dtype=dtype, device=device, group=TPGroup(), config=config, load_format=cfg.load_format)
        self.cache_config: CacheConfig = size_cache(model, cfg, max_model_len)
        self.runner = ModelRunner(model, self.cache_config, device, make_sampler(sampler), runner_settings(cfg, device))
        self.steps_per_launch = self.runner.steps_per_launch  # 1 where the model's step is not static

    def execute(self, plan: StepPlan) -> StepOutput | None:
        return self.runner.execute(plan)

    def heartbeat(self, timeout: float) -> None:
        """One process: nothing can be lost without the engine noticing."""

    def shutdown(self) -> None:
        pass
