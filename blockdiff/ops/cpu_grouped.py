"""blockdiff's own grouped product for bfloat16 experts on CPUs with AVX512-BF16 and no AMX.

A denoising step gives each expert 8-32 rows. At those row counts torch's grouped kernel and
oneDNN's packed one read each expert's weight at 9-23 GB/s on a 2-core EPYC with AVX512-BF16 that
reads 30-120 GB/s (docs/benchmarks.md, "Expert products at memory speed"), and a step of a
large model at batch 1 is bound by those bytes. The kernel (csrc/grouped_bf16.cpp) streams each
expert's weight once in the checkpoint's [out, in] layout, prefetching rows ahead, and takes dot
products 32 inputs at a time with AVX512-BF16's bfloat16 pairs summed into float32 lanes. Every
output row takes the same steps whatever the rows beside it, so requests stay batch-invariant.

It is C++ built on first use with torch.utils.cpp_extension (about 25 s, once per machine: torch
keeps the build under ~/.cache/torch_extensions and rebuilds only when the source changes). Where
it cannot run or build (another CPU, no compiler or ninja) `extension()` is None, says why once in
the log, and the experts keep torch's grouped kernel. CPUs with AMX take their batched products
(ops/kernels.py), measured faster there than torch's grouped kernel; this one has not been
measured on them.
"""

from __future__ import annotations

import functools
import logging
import os
import platform

import torch

from blockdiff.ops.cpu import cpu_features

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "grouped_bf16.cpp")


def runs_here() -> bool:
    """Whether this CPU runs the kernel: x86 with AVX512-BF16, without AMX."""
    features = cpu_features()
    return (platform.machine().lower() in ("x86_64", "amd64") and "avx512_bf16" in features
            and "amx_bf16" not in features)


@functools.cache
def extension():
    """The built kernel's module (`grouped_mm_bf16(x, weight, ends)`), or None where it does not run
    or cannot be built here."""
    if not runs_here():
        return None
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        log.warning("the AVX512-BF16 expert kernel needs ninja to build; bfloat16 experts take torch's grouped kernel")
        return None
    log.info("building the AVX512-BF16 expert kernel (once per machine, about 25 s)")
    try:
        # -fopenmp: at::parallel_for splits the experts over torch's OpenMP threads (the libgomp
        # torch ships answers the extension's link, so one thread pool serves both).
        return cpp_extension.load("blockdiff_grouped_bf16", [SOURCE], extra_cflags=["-O3", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        log.warning("the AVX512-BF16 expert kernel did not build (%s); bfloat16 experts take torch's grouped kernel",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


def grouped_mm_bf16(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                    counts: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows ends[e-1]:ends[e] of bfloat16 x [rows, in] times weight[e] [out, in].T by the kernel, or
    None where it does not apply: another dtype or device, a weight not in the [out, in] layout, or
    no kernel here. With `counts` (int32 [E]) only each group's first counts[e] rows are multiplied
    and the rest of the group is 0: the experts' padding rows (model/moe.py), which cost up to as
    many products as the tokens at batch 1 (8-row alignment of ~8 rows per expert), though skipping them
    did not measurably change a batch-1 generate."""
    if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu"
            or weight.stride(-1) != 1 or x.stride(-1) != 1):
        return None
    ext = extension()
    return None if ext is None else ext.grouped_mm_bf16(x, weight, ends, counts)
