"""Which kernels a model runs on a device: `expert_kernel` and `step_modes`.

From the device type, its compute capability, the dtype and the shapes they decide how a layer's
experts multiply, and whether a step of canvases can run as one static step, compiled and/or
captured as a CUDA graph:

- "grouped": `torch._grouped_mm`, all experts in one call with the offsets on the device. On the
  CPU wherever torch has the kernel (float32 and bfloat16); bfloat16 on CPUs with AVX512-BF16 and no
  AMX runs blockdiff's own grouped kernel instead (ops/cpu_grouped.py), which reads each expert's
  weight once at close to memory speed. On CUDA only where torch runs it
  without reading the offsets on the host: bfloat16 on compute capability 9.x and 10.x (its
  `_grouped_mm_cuda` "fast path"); elsewhere it falls back to a loop that copies the offsets to the
  host, a sync that cannot be captured in a graph.
- "scaled_grouped": FP8 experts as `torch._scaled_grouped_mm` with row-wise scales: CUDA 9.x / 10.x,
  bfloat16 activations that are quantized (a "dynamic" or "static" scheme), dimensions divisible by 16.
- "batched": bfloat16 experts on CPUs with AMX: one `torch.bmm` per projection
  over all experts' rows, each expert's rows padded to the busiest expert's (a multiple of
  BATCH_TILE rows, AMX's tile height). The padded size is read on the host, which on the CPU costs
  nothing; traced code (torch.compile) takes the static bound instead, every token in every expert.
  Where the padding would more than double the rows (`batched_rows`) the call takes the grouped
  product instead: few tokens spread over many experts. On a Xeon with AMX one layer's experts at 64
  tokens took 3.62 ms batched against 5.32 ms grouped; on an AMD EPYC with AVX512-BF16 but no AMX
  the batched products were no faster (0.90-1.10x per layer, 0.92-0.95x per generate), so there
  bfloat16 experts stay grouped (docs/benchmarks.md, "MoE: grouped against per-expert products").
- "per_expert": two products per busy expert, which reads the group sizes on the host: everything
  else. Such a step has a host sync in every layer, so it is neither compiled nor captured.

Every grouped product reads its matrices with leading strides of 16 bytes (and FP8 dimensions
divisible by 16); model/moe.py pads each expert's widths at load time to `padded(n, dtype)`, which
is exact (zero columns of gate/up, zero rows of down), so an unpadded width is a shape `expert_kernel` only
meets when something skipped the padding, and it then takes the per-expert path.

`expert_linear` runs one projection of every expert on rows laid out for the chosen kernel
(`ExpertRows`); the quantization methods (blockdiff/parallel/quantization/) call it, or
`per_expert` with their own product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockdiff.ops import cpu_grouped
from blockdiff.ops.cpu import cpu_features
from blockdiff.ops.matmul import batched_linear, bf16_products_widen, grouped_linear, linear

ALIGN_BYTES = 16  # torch's grouped products: leading strides (and FP8 dimensions) of 16 bytes
FP8 = torch.float8_e4m3fn

GROUPED, SCALED_GROUPED, PER_EXPERT, BATCHED = "grouped", "scaled_grouped", "per_expert", "batched"
BF16_WIDENED = "bf16_widened"  # a CPU feature of Target: no bfloat16 kernels (ops/matmul.py `widens`)
BATCH_TILE = 16  # rows per expert in a batched product are a multiple of this (AMX tiles are 16 rows)
BATCH_MAX_PADDING = 2.0  # a batched call may run at most this many rows per routed pair, else grouped

# Whether static steps are compiled unless the user says, per device type: the faster of compiled
# and eager as measured (docs/benchmarks.md, "Compiled steps"). On CUDA the static steps are CUDA
# graphs either way; compiling adds one inductor compile per shape the server meets, and what it
# buys there has not been measured yet (scripts/device_check.sh's "compiled" part measures it).
COMPILE_BY_DEFAULT = {"cpu": False, "cuda": False}

# torch's grouped kernels without a host sync: compute capability 9.x (Hopper) and 10.x (Blackwell).
_GROUPED_MAJORS = (9, 10)


def padded(n: int, dtype: torch.dtype) -> int:
    """n rounded up to a whole number of 16-byte rows of `dtype` (16 elements of FP8, 8 of bf16, 4 of float32)."""
    step = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-n // step) * step


@dataclass(frozen=True)
class Target:
    """Where the kernels run: a device type and, on CUDA, its compute capability."""

    type: str
    capability: tuple[int, int] | None = None
    features: frozenset[str] = frozenset()  # on the CPU: its ops/cpu.BF16_CPU_FEATURES and BF16_WIDENED (tests inject them)


def target(device: torch.device | str) -> Target:
    device = torch.device(device)
    if device.type == "cpu":
        widened = (BF16_WIDENED,) if bf16_products_widen("cpu") else ()
        return Target("cpu", features=frozenset(cpu_features() + widened))
    if device.type != "cuda":
        return Target(device.type)
    return Target("cuda", tuple(torch.cuda.get_device_capability(device)))


def batched_rows(counts_max: int, pairs: int, experts: int) -> int | None:
    """Rows per expert of a batched call whose busiest expert has `counts_max` of the `pairs` routed
    token-expert pairs, or None where that padding is more than BATCH_MAX_PADDING times the pairs."""
    cap = -(-max(counts_max, 1) // BATCH_TILE) * BATCH_TILE
    return cap if experts * cap <= BATCH_MAX_PADDING * max(pairs, 1) else None


@dataclass(frozen=True)
class ExpertShape:
    """What the experts' products look like on one rank."""

    hidden: int  # the gate/up products' inner dimension (and down's output)
    width: int  # the per-rank intermediate width (down's inner dimension)
    weight_dtype: torch.dtype  # FP8 for FP8 experts, int8 for integer ones
    activations: str | None = None  # FP8 experts: "dynamic", "static" or None (weights only)


@dataclass(frozen=True)
class Ops:
    """Which of the ops `expert_kernel` weighs this torch has."""

    grouped_mm: bool
    scaled_grouped_mm: bool
    cpu_grouped_mm: tuple[torch.dtype, ...]  # the dtypes torch's CPU grouped kernel runs
    # blockdiff's AVX512-BF16 grouped kernel built here (ops/cpu_grouped.py); None: build it when first asked
    cpu_bf16_grouped: bool | None = None


def _cpu_grouped_mm_runs(dtype: torch.dtype) -> bool:
    """torch._grouped_mm is missing before torch 2.8 and had no CPU kernel at first: probed once, at
    import, where no fake or tracing mode can answer for the real kernel."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(16, 16, dtype=dtype)
        w = torch.ones(2, 16, 16, dtype=dtype)
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([8, 16], dtype=torch.int32))
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError):
        return False


INSTALLED = Ops(hasattr(torch, "_grouped_mm"), hasattr(torch, "_scaled_grouped_mm"),
                tuple(d for d in (torch.float32, torch.bfloat16) if _cpu_grouped_mm_runs(d)))


def _aligned(n: int, dtype: torch.dtype) -> bool:
    return n * dtype.itemsize % ALIGN_BYTES == 0


@functools.cache
def expert_kernel(where: Target, dtype: torch.dtype, shape: ExpertShape, ops: Ops | None = None) -> tuple[str, str]:
    """(kernel, why) for experts of `shape` with activations of `dtype` on `where`."""
    ops = ops or INSTALLED
    hopper = where.type == "cuda" and where.capability is not None and where.capability[0] in _GROUPED_MAJORS
    if shape.weight_dtype == FP8:
        if not (hopper and ops.scaled_grouped_mm):
            return PER_EXPERT, "torch._scaled_grouped_mm runs on CUDA compute capability 9.x and 10.x only"
        if shape.activations is None:
            return PER_EXPERT, "weight-only FP8 dequantizes one expert at a time (no FP8 activations to multiply)"
        if dtype != torch.bfloat16:
            return PER_EXPERT, f"torch._scaled_grouped_mm writes bfloat16, the model runs {dtype}"
        if shape.hidden % 16 or shape.width % 16:
            return PER_EXPERT, f"torch._scaled_grouped_mm needs dimensions divisible by 16, not {shape.hidden} x {shape.width}"
        return SCALED_GROUPED, "FP8 row-wise scaled grouped products, offsets on the device"
    if not shape.weight_dtype.is_floating_point:
        return PER_EXPERT, "integer weights are dequantized one expert at a time (blockdiff/ops/intmm.py)"
    if not (_aligned(shape.hidden, shape.weight_dtype) and _aligned(shape.width, shape.weight_dtype)):
        return PER_EXPERT, f"widths {shape.hidden} x {shape.width} of {shape.weight_dtype} miss 16-byte rows (unpadded)"
    if where.type == "cpu":
        if (dtype == torch.bfloat16 and shape.weight_dtype == torch.bfloat16 and "amx_bf16" in where.features
                and dtype in ops.cpu_grouped_mm):
            return BATCHED, (f"one torch.bmm per projection over all experts' rows padded to {BATCH_TILE}-row tiles "
                             f"(AMX; grouped where that padding exceeds {BATCH_MAX_PADDING:g}x)")
        if dtype in ops.cpu_grouped_mm:
            if _own_bf16_kernel(where, dtype, shape, ops):
                return GROUPED, "blockdiff's AVX512-BF16 grouped kernel (blockdiff/ops/cpu_grouped.py), offsets on the device"
            return GROUPED, "torch._grouped_mm's CPU kernel, offsets on the device"
        return PER_EXPERT, f"this torch has no CPU grouped_mm for {dtype}"
    if where.type == "cuda" and ops.grouped_mm:
        if not hopper:
            return PER_EXPERT, (f"torch._grouped_mm on compute capability {where.capability} falls back to a loop "
                                "that reads the offsets on the host")
        if dtype != torch.bfloat16:
            return PER_EXPERT, f"torch._grouped_mm on CUDA runs {dtype} in a loop that reads the offsets on the host"
        return GROUPED, "torch._grouped_mm's bfloat16 kernel, offsets on the device"
    return PER_EXPERT, f"no grouped kernel on {where.type}"


def _own_bf16_kernel(where: Target, dtype: torch.dtype, shape: ExpertShape, ops: Ops) -> bool:
    """Whether bfloat16 experts on `where` take blockdiff's AVX512-BF16 grouped kernel, which reads
    the checkpoint's [out, in] layout (CPUs with AMX take the batched products instead)."""
    if not (where.type == "cpu" and dtype == torch.bfloat16 and shape.weight_dtype == torch.bfloat16
            and "avx512_bf16" in where.features and "amx_bf16" not in where.features):
        return False
    return ops.cpu_bf16_grouped if ops.cpu_bf16_grouped is not None else cpu_grouped.extension() is not None


def transposed_layout(where: Target, dtype: torch.dtype, shape: ExpertShape, ops: Ops | None = None) -> bool:
    """Whether experts of `shape` on `where` keep each expert's [out, in] weight in memory as
    [in, out] (the same tensor to every reader): torch's CPU grouped kernel multiplies float32 by such
    a weight in 0.67-0.93x the time it takes through a transposed view of the checkpoint's layout,
    with the same bits (docs/benchmarks.md, "CPU step costs"). bfloat16 on CPUs with bfloat16
    kernels keeps this layout too, a choice made before and not measured for that dtype. Where the CPU has no
    bfloat16 kernels (BF16_WIDENED) torch's generic loops read that layout 6x slower (24 x 256 x 256:
    2.36 against 0.37 ms, EPYC Zen 3), so bfloat16 experts keep the checkpoint's. CUDA's grouped
    kernels and the CPU's batched products (torch.bmm, whose oneDNN kernel read that layout faster:
    docs/benchmarks.md, "MoE: grouped against per-expert products") take the checkpoint's layout."""
    if where.type != "cpu" or expert_kernel(where, dtype, shape, ops)[0] != GROUPED:
        return False
    if _own_bf16_kernel(where, dtype, shape, ops or INSTALLED):
        return False
    return not (dtype == torch.bfloat16 and BF16_WIDENED in where.features)


def transposed_experts(device: torch.device, dtype: torch.dtype, shape: ExpertShape) -> bool:
    """`transposed_layout` on `device`."""
    return transposed_layout(target(device), dtype, shape)


@torch.compiler.assume_constant_result  # traced code takes the answer as a constant
def kernel_on(device: torch.device, dtype: torch.dtype, shape: ExpertShape) -> str:
    """The experts' kernel for tensors of `dtype` on `device`."""
    return expert_kernel(target(device), dtype, shape)[0]


def static_kernel(kernel: str) -> bool:
    """Whether a step whose experts use `kernel` has static shapes and no host sync."""
    return kernel != PER_EXPERT


@dataclass(frozen=True)
class ExpertRows:
    """How the experts' rows are laid out for their kernel: exactly one of `ends`, `sizes` and
    `experts` is set (`counts` goes with `ends`)."""

    ends: torch.Tensor | None = None  # grouped kernels: int32 ends of each expert's rows, on the device
    # grouped kernels: int32 rows of tokens each expert's rows begin with (the rest up to its end pad
    # it to an aligned start for the next), or None: all of them
    counts: torch.Tensor | None = None
    sizes: list[int] | None = None  # per expert: each expert's row count, read on the host
    experts: int | None = None  # batched: the rows are [experts, rows per expert]


def per_expert(x: torch.Tensor, sizes: list[int], product: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """`product(rows, e)` over each busy expert's rows of x (the first sum(sizes) rows), concatenated."""
    busy = [e for e, s in enumerate(sizes) if s]
    counts = [sizes[e] for e in busy]
    return torch.cat([product(part, e) for part, e in zip(x[: sum(counts)].split(counts), busy)])


def expert_linear(x: torch.Tensor, weight: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    """Each expert's rows of x [rows, in] times its weight[e] [out, in].T, by the kernel `rows` is laid out for."""
    if rows.ends is not None:
        return grouped_linear(x, weight, rows.ends, rows.counts)
    if rows.experts is not None:
        return batched_linear(x.view(rows.experts, -1, x.shape[-1]), weight).view(x.shape[0], -1)
    return per_expert(x, rows.sizes, lambda part, e: linear(part, weight[e]))


@dataclass(frozen=True)
class StepModes:
    compile: bool  # steps of canvases compiled with torch.compile(fullgraph=True)
    cuda_graphs: bool  # ...and/or captured once per shape as CUDA graphs and replayed
    why: str


def step_modes(where: Target, static: bool, compile: bool | None, cuda_graphs: bool) -> StepModes:
    """How steps of canvases run, from what the user asked (`compile` None: the device's default;
    `cuda_graphs`: unless --enforce-eager) and whether the model's step is `static`. At every
    tensor-parallel size: under compile the collectives are functional ones (parallel/group.py)."""
    if compile and not static:
        raise ValueError(f"compile=True needs a step with static shapes, which this model cannot run on {where.type}: "
                         "its experts read group sizes on the host (see blockdiff/ops/kernels.py)")
    if compile is None:
        compile = COMPILE_BY_DEFAULT.get(where.type, False) and static
    graphs = cuda_graphs and static and where.type == "cuda"
    if not static:
        why = "eager: the experts read group sizes on the host"
    else:
        why = " and ".join(m for m, on in (("compiled", compile), ("CUDA graphs", graphs)) if on) or "eager"
    return StepModes(bool(compile), graphs, why)
