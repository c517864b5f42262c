"""`linear(x, weight)`: x @ weight.T through the fastest exact kernel of the device.

On x86 CPUs PyTorch sends float32 `F.linear` to MKL's sgemm, which takes an AVX2 path on AMD
processors; oneDNN's float32 kernel uses AVX-512 where the CPU has it and runs the same products
about twice as fast (docs/benchmarks.md), so it is used where the CPU has AVX-512. It is full
float32 arithmetic, like sgemm. Like sgemm it computes a row the same way wherever it sits in a
product whose row count is a multiple of 8, which keeps requests batch-invariant (see ROW_ALIGN in
model/attention.py). bfloat16 `F.linear` already runs on oneDNN wherever torch has its bfloat16
kernels (AVX512-BF16, AMX, or AVX-512 emulating them). Elsewhere (an x86 CPU without AVX-512) torch
has no bfloat16 kernel: its products convert every element in generic loops at 1-4 GFLOP/s, 3-57x
slower than multiplying the same operands in float32 (docs/benchmarks.md, "bfloat16 without
bfloat16 products"). There `linear` multiplies in float32, widening the weight a tile at a time in memory
order, and rounds the result to bfloat16 once (`widens`, `_float32_linear`).

Given a plain weight, oneDNN reorders it into its blocked layout on every call; a parameter's
weight is reordered once and kept (`_packed`), in both dtypes: the same bits as `F.linear`, 5-20%
less time per float32 product at the 15.8M checkpoint's shapes, 1.04-1.23x faster bfloat16
products at the 319M one's (docs/benchmarks.md). The blocked copies are kept beside the parameters: the dense
weights' memory twice over (the tied embedding three times: itself, the LM head's copy and the
soft embedding's, of its transpose), the experts' not at all (they take the grouped products). Everything else (GPUs, float16, where
oneDNN is missing, training, and code traced by torch.compile, whose inductor cannot lower the
oneDNN op) stays on `F.linear`.

`grouped_linear` runs many experts' products in one call (`torch._grouped_mm`) with the group
offsets on the device, so no per-expert row count ever reaches the host; `batched_linear` runs them
as one `torch.bmm` over experts' rows padded to one count (model/moe.py, kernels.BATCHED).
"""

from __future__ import annotations

import platform
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from blockdiff.ops import cpu_grouped

_ONEDNN_AVAILABLE = (
    torch.backends.mkldnn.is_available()
    and platform.machine().lower() in ("x86_64", "amd64")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
# Only with AVX-512 is oneDNN the faster kernel: on an AVX2-only CPU whole generations took 0.95x the
# time with MKL and SDPA instead (benchmarks/onednn_products.py, docs/benchmarks.md).
_ONEDNN_FP32 = _ONEDNN_AVAILABLE and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
# Where torch runs bfloat16 products on oneDNN at all (F.linear's kernel too): packing changes only
# how often the weight is reordered.
_ONEDNN_BF16 = (_ONEDNN_AVAILABLE and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())

# x86 without oneDNN's bfloat16 kernels: bfloat16 products there run in torch's generic loops.
_BF16_BY_LOOPS = platform.machine().lower() in ("x86_64", "amd64") and not _ONEDNN_BF16
WIDEN_ELEMENTS = 1 << 20  # weight elements widened to float32 at a time (4 MiB: a cache-sized tile)


def bf16_products_widen(device_type: str) -> bool:
    """Whether bfloat16 products on `device_type` run in float32 (a CPU without bfloat16 kernels)."""
    return device_type == "cpu" and _BF16_BY_LOOPS


def widens(x: torch.Tensor) -> bool:
    """Whether products of `x` run in float32 and round to its dtype once (`bf16_products_widen`)."""
    return x.dtype == torch.bfloat16 and bf16_products_widen(x.device.type)


def _onednn(device_type: str, dtype: torch.dtype) -> bool:
    # the flags are read at every call: benchmarks/onednn_products.py switches them
    return device_type == "cpu" and {torch.float32: _ONEDNN_FP32, torch.bfloat16: _ONEDNN_BF16}.get(dtype, False)


def onednn_packed(x: torch.Tensor) -> bool:
    """Whether `linear` runs products of `x` on oneDNN with the weight packed once. Not when `x`
    needs a gradient (the demo trainer): the oneDNN op has no autograd formula."""
    return _onednn(x.device.type, x.dtype) and not x.requires_grad and not torch.compiler.is_compiling()


def dense_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """What `linear` runs for activations of `dtype` on `device`, as the startup summary says it."""
    kind = torch.device(device).type
    if _onednn(kind, dtype):
        return "oneDNN, weights packed once"
    if dtype == torch.bfloat16 and bf16_products_widen(kind):
        return "float32, the bfloat16 weights widened a tile at a time"
    return "F.linear"


# Per parameter (by id, dropped with it): (what the copy is, data pointer, shape, strides) of a view
# of it -> (the parameter's version when made, the copy).
_PACKED: dict[int, dict[tuple, tuple[int, torch.Tensor]]] = {}


def packed_copy(weight: torch.Tensor, kind: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """make(weight), a kernel's own layout of `weight` (`kind` names it), kept while `weight` is (a
    view of) a parameter: made on its first use and again after the parameter is written in place.
    None for other tensors (an FP8 weight dequantized for one product, a parameter made under
    inference_mode, which keeps no version counter to notice writes by)."""
    base = weight if weight._base is None else weight._base
    if not isinstance(base, nn.Parameter) or base.is_inference():
        return None
    views = _PACKED.get(id(base))
    if views is None:
        views = _PACKED[id(base)] = {}
        weakref.finalize(base, _PACKED.pop, id(base), None)
    key = (kind, weight.data_ptr(), tuple(weight.shape), weight.stride())
    hit = views.get(key)
    if hit is None or hit[0] != base._version:
        hit = views[key] = (base._version, make(weight))
    return hit[1]


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a parameter's `weight` (`packed_copy`; the same bits as the plain
    layout, which other tensors keep)."""
    packed = packed_copy(weight, "onednn", torch.ops.mkldnn._reorder_linear_weight)
    return weight if packed is None else packed


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in].T; `weight` may be a transposed view."""
    if onednn_packed(x) and not weight.requires_grad and x.numel():
        return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), None, "none", [], "")
    if widens(x):
        return _float32_linear(x, weight)
    return F.linear(x, weight)


def _float32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float32, rounded to x's dtype once. The weight is widened WIDEN_ELEMENTS at a
    time along its memory order, so no float32 copy of it (or of a wide x) is ever whole: a plain
    [out, in] weight by output rows; a transposed view (the soft embedding's [vocab, hidden] table
    read as [hidden, vocab]) by input columns, the partial products summed in float32. The tiles
    depend on the weight's shape alone, so a row's result does not depend on the batch."""
    rows, (n_out, n_in) = x.shape[:-1], weight.shape
    if weight.stride(0) == 1 and n_in > 1:
        step = max(1, WIDEN_ELEMENTS // n_out)
        acc = x.new_zeros(*rows, n_out, dtype=torch.float32)
        for a in range(0, n_in, step):
            acc += F.linear(x[..., a : a + step].float(), weight[:, a : a + step].float())
        return acc.to(x.dtype)
    step = max(1, WIDEN_ELEMENTS // max(n_in, 1))
    xf, out = x.float(), x.new_empty(*rows, n_out)
    for a in range(0, n_out, step):
        out[..., a : a + step] = F.linear(xf, weight[a : a + step].float())
    return out


# torch._grouped_mm's fake-tensor rule only accepts bfloat16 (torch 2.13), although the CPU kernel
# runs float32 too: wrapped as an opaque op with its own shape rule, it compiles in every dtype.
@torch.library.custom_op("blockdiff::grouped_mm", mutates_args=())
def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    ours = cpu_grouped.grouped_mm_bf16(x, weight, ends, counts)  # bfloat16 on AVX512-BF16, [out, in] weights
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends) if ours is None else ours


@_grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == torch.bfloat16:  # torch's own rule, with its dtype, stride and offset checks
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    return x.new_empty(x.shape[0], weight.shape[1])


def _grouped_mm_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:3])


def _grouped_mm_backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    """The gradients as grouped products too: rows past ends[-1] get none (their outputs are
    undefined, so nothing reads them), a group without rows a zero weight gradient."""
    x, weight, ends = ctx.saved_tensors
    grad_x = torch._grouped_mm(grad, weight, offs=ends)
    grad_x.masked_fill_((torch.arange(x.shape[0], device=x.device) >= ends[-1])[:, None], 0)
    grad_weight = torch._grouped_mm(grad.t(), x, offs=ends)
    return grad_x, grad_weight, None, None


# The demo trainer differentiates the experts' products.
_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ends[g-1]:ends[g] of x [rows, in] times weight[g] [out, in].T, in one call; `ends`
    int32 on x's device. Rows past ends[-1] are left undefined. `counts` (int32, where given): how
    many rows each group begins with that matter; a kernel may give the rest of the group 0."""
    return _grouped_mm(x, weight, ends, counts)


def batched_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [E, rows, in] @ weight [E, out, in].T per expert, one torch.bmm (oneDNN's batched kernel on
    the CPU); `weight` in the checkpoint's layout, read through a transposed view."""
    return torch.bmm(x, weight.transpose(1, 2))
