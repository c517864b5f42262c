"""The tensor-parallel executor: the model split over N processes, driven by the engine as rank 0.

Every rank loads only its slices of the checkpoint and builds a `ModelRunner` on its own device.
Each step, rank 0 sends the `StepPlan` to the workers and runs it itself; the collectives inside
the model and the sampler keep the ranks in step, and rank 0's `StepOutput` is the result.

When the group fails (a worker died, hung past `worker_timeout`, or raised), every call raises
`WorkerLost` until `restart()` has started new workers with freshly loaded weights and an empty
cache; what the old group held is gone, and the engine must forget the requests that had started.
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager

import torch

from blockdiff.config import EngineConfig, ModelConfig
from blockdiff.diffusion.registry import make_sampler
from blockdiff.model.loader import load_model
from blockdiff.model.registry import model_class
from blockdiff.parallel.group import TPGroup
from blockdiff.parallel.ranks import RankContext, RankProcesses, WorkerError, WorkerLost
from blockdiff.executor.local import runner_settings
from blockdiff.step import CacheConfig, StepOutput, StepPlan
from blockdiff.worker.kv_cache import size_cache
from blockdiff.worker.model_runner import ModelRunner, RunnerSettings


class TPExecutor:
    def __init__(self, cfg: EngineConfig, config: ModelConfig, dtype: torch.dtype, device: str, max_model_len: int,
                 sampler: str):
        check_splittable(config, cfg.tensor_parallel_size)
        self._cfg, self._config, self._dtype, self._device, self._max_model_len = cfg, config, dtype, device, max_model_len
        self._sampler = sampler
        self._settings = runner_settings(cfg, device)
        self.worker_timeout: float = cfg.worker_timeout
        self.cache_config: CacheConfig | None = None
        self._shut = False
        self._stepping = False  # shutdown() may come from another thread while a step waits on a worker
        self.ranks = self._start()

    def _start(self) -> RankProcesses:
        cfg = self._cfg
        # The workers run as many intra-op threads as rank 0 was given, passed to them explicitly.
        env = {} if cfg.num_threads is None else {"OMP_NUM_THREADS": str(cfg.num_threads)}
        ranks = RankProcesses(cfg.tensor_parallel_size, self._device, step_timeout=datetime.timedelta(seconds=self.worker_timeout),
                              env=env)
        try:
            ranks.run(_load, cfg.model, self._config, self._dtype, cfg.load_format, gather=True)
            if self.cache_config is None:
                # Sized once on rank 0 and sent to all: every rank holds the same number of KV heads.
                self.cache_config = size_cache(ranks.context.state["model"], cfg, self._max_model_len)
            ranks.run(_start_runner, self.cache_config, self._sampler, self._settings, gather=True)
            # Every rank builds the same runner: rank 0's (this process) says what the steps can do.
            self.steps_per_launch = ranks.context.state["runner"].steps_per_launch
        except BaseException:
            ranks.close(abort=True)
            raise
        return ranks

    def execute(self, plan: StepPlan) -> StepOutput | None:
        self._stepping = True
        try:
            with self._lost_on_failure():
                return self.ranks.run(_execute, plan)
        finally:
            self._stepping = False

    def heartbeat(self, timeout: float) -> None:
        """Raise WorkerLost unless every worker is alive and answers within `timeout` seconds."""
        with self._lost_on_failure():
            self.ranks.ping(timeout)

    @contextmanager
    def _lost_on_failure(self):
        """An error that closed the group becomes WorkerLost (with the cause's message, for the log)."""
        try:
            yield
        except Exception as e:
            if not self.ranks.closed:
                raise
            raise WorkerLost(str(e) if isinstance(e, WorkerError) else f"{type(e).__name__}: {e}") from e

    def restart(self) -> None:
        """Replace the group with new workers that load the weights again (the cache starts empty).
        Raises what starting them raised; then the old group stays closed and restart() may be retried."""
        if self._shut:
            raise WorkerLost("the executor is shut down")
        self.ranks.close(abort=True)
        ranks = self._start()
        if self._shut:  # shutdown() ran while the new workers started
            ranks.close()
            raise WorkerLost("the executor is shut down")
        self.ranks = ranks

    def shutdown(self) -> None:
        self._shut = True
        # A polite shutdown of the group would wait for the collective in flight, which may never end.
        self.ranks.close(abort=self._stepping)


def check_splittable(config: ModelConfig, size: int) -> None:
    """Raise ValueError before any process starts if the model cannot be split over `size` ranks:
    rank 0's model is built on the meta device, which runs every layer's own split rules."""
    try:
        with torch.device("meta"):
            model_class(config)(config, group=TPGroup(rank=0, size=size), dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size={size}: {e}") from e


def _load(ctx: RankContext, path: str, config: ModelConfig, dtype: torch.dtype, load_format: str) -> None:
    ctx.state["model"] = load_model(path, dtype=dtype, device=ctx.device, group=ctx.group, config=config,
                                    load_format=load_format)


def _start_runner(ctx: RankContext, cache: CacheConfig, sampler: str, settings: RunnerSettings) -> None:
    ctx.state["runner"] = ModelRunner(ctx.state["model"], cache, ctx.device, make_sampler(sampler), settings)


def _execute(ctx: RankContext, plan: StepPlan) -> StepOutput | None:
    return ctx.state["runner"].execute(plan)
