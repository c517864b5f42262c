"""Starting an engine from the edges (LLM, the server): device check, thread count, and the
startup summary a user reads to see what runs with which limits."""

from __future__ import annotations

import logging
import os
import re

import torch

from blockdiff.config import ModelConfig, parse_dtype
from blockdiff.engine.engine import EngineConfig, LLMEngine

log = logging.getLogger("blockdiff")

# Below this hidden size one op's work is too small to split over threads: every op then waits
# for all threads to be scheduled, and on a busy machine that took the demo model from 0.2 s to
# 0.65 s per request (docs/quickstart.md, "Threads").
_SINGLE_THREAD_HIDDEN_SIZE = 512


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


def configure_threads(cfg: EngineConfig, model_config: ModelConfig) -> str:
    """Set torch's intra-op threads for this process; -> the count and why, for the summary.
    OMP_NUM_THREADS, when set, always wins (tensor-parallel workers inherit it too)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    if cfg.resolved_device() == "cpu" and model_config.hidden_size < _SINGLE_THREAD_HIDDEN_SIZE:
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # for tensor-parallel workers started after this
        return (f"1 (hidden size {model_config.hidden_size} is too small to split ops over threads; "
                "set OMP_NUM_THREADS to choose)")
    return f"{torch.get_num_threads()} (torch's default, one per core; set OMP_NUM_THREADS to choose)"


def start_engine(cfg: EngineConfig) -> LLMEngine:
    """Check the device, choose threads, build the engine and log its summary at INFO."""
    check_device(cfg.device)
    if not os.path.isdir(cfg.model):
        raise ValueError(f"model {cfg.model!r} is not a checkpoint directory")
    threads = configure_threads(cfg, ModelConfig.from_pretrained(cfg.model))
    engine = LLMEngine(cfg)
    for line in summary(engine, threads):
        log.info("%s", line)
    return engine


def summary(engine: LLMEngine, threads: str) -> list[str]:
    """The startup summary, one log line each."""
    cfg, cache = engine.cfg, engine.cache
    dtype = str(parse_dtype(cfg.dtype, engine.model_config)).removeprefix("torch.")
    return [
        f"model {cfg.model}: {dtype} on {cfg.resolved_device()}, tensor parallel size {cfg.tensor_parallel_size}",
        f"threads: {threads}",
        f"max_model_len {engine.max_model_len}, max_num_seqs {cache.num_slots}, "
        f"KV cache {cache.num_blocks} blocks x {cache.block_size} = {cache.num_blocks * cache.block_size} tokens",
    ]
