"""Starting an engine from the edges (LLM, the server): device check, thread count, and the
startup summary a user reads to see what runs with which limits."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import replace

import torch

from blockdiff.config import EngineConfig, ModelConfig, choose_dtype
from blockdiff.engine.async_engine import AsyncEngine
from blockdiff.engine.client import EngineClient
from blockdiff.engine.dp_client import DPClient
from blockdiff.engine.engine import LLMEngine
from blockdiff.model.registry import load_config
from blockdiff.ops.kernels import ExpertShape, expert_kernel, padded, target
from blockdiff.ops.matmul import dense_kernel
from blockdiff.step import CacheConfig

log = logging.getLogger("blockdiff")

# Below this hidden size one op's work is too small to split over threads: every op then waits
# for all threads to be scheduled, and on a busy machine that took the demo model from 0.2 s to
# 0.65 s per request (docs/quickstart.md, "Threads").
_SINGLE_THREAD_HIDDEN_SIZE = 512
_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # before anything here changes it
_chosen: int | None = None  # the count the last start_engine set (another one was the user's)


def check_device(device: str) -> None:
    """ValueError for a device this torch build cannot run, naming what to use instead."""
    if device in ("auto", "cpu"):
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device {device!r} is not supported: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        build = "has no CUDA support" if torch.version.cuda is None else "finds no GPU"
        raise ValueError(f"device {device!r} is not available: this torch {torch.__version__} {build}; "
                         "use the cpu device (--device cpu)")


def choose_threads(cfg: EngineConfig, model_config: ModelConfig) -> tuple[int, str]:
    """-> torch's intra-op thread count for the engine's processes, and why (for the summary).
    OMP_NUM_THREADS, when set, always wins."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    if torch.get_num_threads() not in (_TORCH_DEFAULT_THREADS, _chosen):
        return torch.get_num_threads(), "set by torch.set_num_threads before"
    if cfg.resolved_device() == "cpu" and model_config.hidden_size < _SINGLE_THREAD_HIDDEN_SIZE:
        return 1, f"hidden size {model_config.hidden_size} is too small to split ops over threads; set OMP_NUM_THREADS to choose"
    return _TORCH_DEFAULT_THREADS, "torch's default, one per core; set OMP_NUM_THREADS to choose"


def start_engine(cfg: EngineConfig) -> LLMEngine:
    """Check the device, choose threads, build the engine and log its summary at INFO."""
    check_device(cfg.device)
    cfg.check_model()
    global _chosen
    threads, why = choose_threads(cfg, load_config(cfg.model))
    torch.set_num_threads(threads)
    _chosen = threads
    engine = LLMEngine(replace(cfg, num_threads=threads))  # the workers get the same count
    for line in summary(engine, f"{threads} ({why})"):
        log.info("%s", line)
    return engine


def start_client(cfg: EngineConfig, max_queued_requests: int | None = None) -> EngineClient:
    """The engine client a server runs: one local engine (`AsyncEngine`), or with
    data_parallel_size > 1 and no data_parallel_rank, the front end of that many replica processes
    (each queueing at most `max_queued_requests`)."""
    if cfg.data_parallel_size == 1 or cfg.data_parallel_rank is not None:
        return AsyncEngine(start_engine(cfg), max_queued_requests)
    check_device(cfg.device)
    cfg.check_model()
    env = {}
    if cfg.resolved_device() == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        # The replicas share the cores: each takes its share of what one engine would take.
        threads, _ = choose_threads(cfg, load_config(cfg.model))
        env["OMP_NUM_THREADS"] = str(max(1, threads // cfg.data_parallel_size))
    log.info("starting %d engine replicas%s", cfg.data_parallel_size,
             f" with {env['OMP_NUM_THREADS']} threads each" if env else "")
    return DPClient(cfg, start_engine, max_queued_requests, env)


def kv_dtype(cache: CacheConfig, model_dtype: str) -> str:
    """The KV cache's entries, as the summary says them."""
    if cache.kv_cache_dtype == "auto":
        return f"{model_dtype} entries"
    scales = "first prefill's" if cache.calculate_kv_scales else "checkpoint's or 1.0"
    return f"fp8 (float8_e4m3fn) entries, per-layer scales ({scales})"


def kernels_line(model_config: ModelConfig, dtype: torch.dtype, device: str, tp: int) -> str:
    """Which kernels the dense products (blockdiff/ops/matmul.py) and the experts' products
    (blockdiff/ops/kernels.py) take, as the summary says it."""
    dense = f"kernels: dense products {dense_kernel(device, dtype)}; "
    arch = model_config.arch
    width = getattr(arch, "moe_intermediate_size", None)
    if not width or not getattr(arch, "num_experts", 0):
        return dense + "no experts"
    if getattr(arch, "quantization", None) is not None:
        return dense + "experts quantized (blockdiff/ops/kernels.py chooses per layer)"
    shape = ExpertShape(padded(arch.hidden_size, dtype), padded(-(-width // tp), dtype), dtype)
    kernel, why = expert_kernel(target(device), dtype, shape)
    return dense + f"experts {kernel} ({why})"


def summary(engine: LLMEngine, threads: str) -> list[str]:
    """The startup summary, one log line each."""
    cfg, cache = engine.cfg, engine.executor.cache_config
    device = cfg.resolved_device()
    chosen, reason = choose_dtype(cfg.dtype, engine.model_config, device)
    dtype = str(chosen).removeprefix("torch.")
    return [
        f"model {cfg.model}: {dtype} on {device}, tensor parallel size {cfg.tensor_parallel_size}",
        f"dtype {dtype}: {reason}; " + kernels_line(engine.model_config, chosen, device, cfg.tensor_parallel_size),
        f"threads: {threads}",
        f"max_model_len {engine.max_model_len}, max_num_seqs {cache.num_slots}, "
        f"KV cache {cache.num_blocks} blocks x {cache.block_size} = {cache.num_blocks * cache.block_size} tokens, "
        f"{kv_dtype(cache, dtype)}",
    ]
