"""Where the model runs: in this process (one device) or on a tensor-parallel group of processes.
An executor sizes the KV cache on its model and reports it as `cache_config`."""

from __future__ import annotations

import torch

from blockdiff.config import EngineConfig, ModelConfig


def make_executor(cfg: EngineConfig, config: ModelConfig, dtype: torch.dtype, device: str, max_model_len: int,
                  sampler: str):
    """sampler: the name of the diffusion sampler every rank runs."""
    if cfg.tensor_parallel_size == 1:
        from blockdiff.executor.local import LocalExecutor

        return LocalExecutor(cfg, config, dtype, device, max_model_len, sampler)
    from blockdiff.executor.tensor_parallel import TPExecutor

    return TPExecutor(cfg, config, dtype, device, max_model_len, sampler)
