"""Keep freed memory in the process heap while the engine runs on the CPU.

Every step allocates and frees the same large tensors (logits and probabilities of
[tokens, vocabulary] float32, MoE buffers). glibc serves blocks above its mmap threshold with fresh
mmap()s and returns them on free, so every step pays a page fault for each of their pages — 430k
faults, a sixth of the CPU time, for a batch of 8 on the 15M benchmark model (docs/benchmarks.md).
With mmap off and heap trimming deferred, freed blocks are reused instead. This is what
`MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...` in the environment would do, applied once by each
process that runs a model on the CPU (ModelRunner) when `EngineConfig.tune_cpu_heap` is set — the
`blockdiff` commands set it, library users opt in with `LLM(..., tune_cpu_heap=True)` — since it
affects the whole process: memory freed is kept for reuse, not handed back to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied = False


def keep_freed_memory() -> bool:
    """Apply the heap settings (glibc only); -> whether they are in effect."""
    global _applied
    if _applied:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    if _applied:
        log.debug("heap: mmap off, trimming deferred")
    return _applied


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere): after a
    rare large allocation, such as a decoded image, which the settings above would otherwise keep."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        trim = None
    if trim is not None:
        trim(0)


def status_bytes(field: str) -> int:
    """A size field of Linux's /proc/self/status (`VmHWM`, `RssAnon`, ...), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def resident_bytes() -> int:
    """The process's resident memory now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
