"""A fake CUDA device on this CPU-only torch (DESIGN.md §10), for the tests that check the CUDA path.

`FakeTensorMode` makes `cuda` tensors that hold no memory, runs every op's shape rule, raises
`FakeTensorDeviceMismatchError` when a CPU tensor meets a CUDA one and
`DataDependentOutputException` on a host read of device data (`.item()`, `bool(t)`, `.tolist()`).
What the mode does not know is the GPU: `torch.cuda.get_device_capability` is answered with the
capability asked for (an H200 is (9, 0)), and the grouped products' CUDA-only checks, which torch's
fake rules leave out, are restated here from `aten/src/ATen/native/cuda/GroupedBlas.cpp` and run on
every call (`GroupedCalls`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch
from torch._C._distributed_c10d import FakeProcessGroup
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from blockdiff.ops.kernels import FP8
from blockdiff.parallel.group import TPGroup


def fake_group(size: int, rank: int = 0) -> TPGroup:
    """Rank `rank` of a group of `size` whose collectives move nothing: torch's FakeProcessGroup
    ("hallucinates communication", for shape checks on one process). Every rank's shapes are the
    same, so rank 0 stands for all; the numbers are not a sharded model's (nothing is reduced)."""
    create = getattr(FakeProcessGroup, "_create_internal", None) or FakeProcessGroup
    return TPGroup(rank=rank, size=size, backend=create(rank, size))


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int] = (9, 0)):
    """-> the FakeTensorMode; inside it, tensors made on "cuda" are fake CUDA tensors of a GPU of
    `capability`. Real CPU tensors may take part (the mode turns them into fake ones)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, PythonBindings():
            yield mode


class PythonBindings(TorchFunctionMode):
    """`t[...]`, `t[...] = v`, `t.to(...)`, `t.copy_(...)`, `t.cuda()`, `t.contiguous()` on fake CUDA
    tensors and `torch.tensor(..., device="cuda")`, through the ATen ops they stand for.

    Those are Python bindings that set a CUDA device guard before they dispatch, and a CPU-only
    torch has no CUDA guard ("PyTorch is not linked with support for cuda devices"); every ATen op,
    the fake ones included, runs without one. Indexing is taken apart as torch's binding does
    (python_variable_indexing.cpp): integers select, slices slice, None unsqueezes, Ellipsis skips
    dimensions, and the tensor indices left make one `aten.index` (or `index_put_`) call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            view, tensors = _basic_indexing(*args)
            return view if tensors is None else torch.ops.aten.index.Tensor(view, tensors)
        if func is torch.Tensor.__setitem__:
            t, index, value = args
            view, tensors = _basic_indexing(t, index)
            if not isinstance(value, torch.Tensor):
                value = torch.full((), value, dtype=t.dtype, device=t.device)
            if tensors is None:
                torch.ops.aten.copy_.default(view, value)
            else:
                torch.ops.aten.index_put_.default(view, tensors, _to(value, dtype=t.dtype))
            return None
        if func is torch.Tensor.copy_:
            return torch.ops.aten.copy_.default(args[0], args[1], kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        if func is torch.Tensor.to:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            return _to(args[0], device, dtype, non_blocking)
        if func is torch.Tensor.cuda:
            return _to(args[0], torch.device("cuda"))
        if func is torch.tensor and kwargs.get("device") is not None:  # under inference_mode it misses the fake mode
            device = torch.device(kwargs.pop("device"))
            return _to(func(*args, **kwargs), device)
        if func is torch.Tensor.contiguous and not args[0].is_contiguous():
            return torch.ops.aten.clone.default(args[0], memory_format=torch.contiguous_format)
        return func(*args, **kwargs)


def _to(t: torch.Tensor, device=None, dtype=None, non_blocking: bool = False) -> torch.Tensor:
    if (device is None or torch.device(device) == t.device) and (dtype is None or dtype == t.dtype):
        return t
    return torch.ops.aten._to_copy.default(t, dtype=dtype or t.dtype, device=device or t.device, non_blocking=non_blocking)


def _basic_indexing(t: torch.Tensor, index) -> tuple[torch.Tensor, list | None]:
    """(the view that integers, slices, None and Ellipsis make, the per-dimension tensor indices for
    aten.index over it or None when there are none)."""
    items = list(index) if isinstance(index, tuple) else [index]
    items = [torch.tensor(i, device=t.device) if isinstance(i, list) else i for i in items]
    if any(i is Ellipsis for i in items):
        at = next(k for k, i in enumerate(items) if i is Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (t.dim() - used)
    view, dim, tensors = t, 0, []
    for i in items:
        if i is None:
            view = view.unsqueeze(dim)
            tensors.append(None)
            dim += 1
        elif isinstance(i, bool) or isinstance(i, torch.Tensor):
            tensors.append(i)
            dim += 1
        elif isinstance(i, int):
            view = view.select(dim, i)
        elif isinstance(i, slice):
            start, stop, step = i.start or 0, view.shape[dim] if i.stop is None else i.stop, i.step or 1
            view = torch.ops.aten.slice.Tensor(view, dim, start, stop, step)
            tensors.append(None)
            dim += 1
        else:
            raise TypeError(f"index {i!r} of type {type(i).__name__}")
    if not any(isinstance(x, torch.Tensor) for x in tensors):
        return view, None
    while tensors and tensors[-1] is None:
        tensors.pop()
    return view, tensors


def fake_module(build, device: str = "cuda"):
    """build() made on `meta` (no memory, no init kernels), then given fake CUDA storage; call
    inside `fake_cuda()`. Building under the mode directly fails: nn.Linear's init asks for a CUDA
    generator."""
    with unset_fake_temporarily(), torch.device("meta"):
        module = build()
    return module.to_empty(device=device)


def _leading_stride_ok(mat: torch.Tensor) -> bool:
    """The CUDA op's check_valid_strides_and_return_transposed: one of the last two dimensions is
    contiguous and the other's stride is a multiple of 16 bytes."""
    s, align = mat.stride(), 16 // mat.element_size()
    if s[-1] == 1 and s[-2] >= max(1, mat.shape[-1]):
        return s[-2] % align == 0
    if s[-2] == 1 and s[-1] >= max(1, mat.shape[-2]):
        return s[-1] % align == 0
    return False


@dataclass
class GroupedCalls:
    """The grouped products a forward called, each checked as torch's CUDA kernels check them."""

    grouped: list[tuple] = field(default_factory=list)  # (mat_a shape, mat_b shape, dtype)
    scaled: list[tuple] = field(default_factory=list)

    @contextlib.contextmanager
    def watch(self):
        grouped_mm, scaled_grouped_mm = torch._grouped_mm, torch._scaled_grouped_mm

        def checked_grouped(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
            assert mat_a.is_cuda and mat_b.is_cuda and offs.is_cuda, "grouped_mm operands off the GPU"
            assert mat_a.dtype == mat_b.dtype == torch.bfloat16, f"no-sync grouped_mm needs bfloat16, got {mat_a.dtype}"
            assert offs.dtype == torch.int32 and offs.dim() == 1 and offs.shape[0] == mat_b.shape[0]
            assert _leading_stride_ok(mat_a) and _leading_stride_ok(mat_b), "strides should be multiple of 16 bytes"
            self.grouped.append((tuple(mat_a.shape), tuple(mat_b.shape), mat_a.dtype))
            return grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

        def checked_scaled(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                           use_fast_accum=False):
            assert all(t.is_cuda for t in (mat_a, mat_b, scale_a, scale_b, offs)), "scaled_grouped_mm operands off the GPU"
            assert mat_a.dtype == mat_b.dtype == FP8, (mat_a.dtype, mat_b.dtype)
            # _scaled_grouped_mm_cuda: mat_a row-major, mat_b column-major ("transposed") ...
            assert mat_a.stride(-1) == 1 and mat_b.stride(-2) == 1, "mat_a row-major, mat_b column-major"
            # ... "Expected trailing dimension of mat_a to be divisible by 16", and mat_b's both ...
            assert mat_a.shape[-1] % 16 == 0 and mat_b.shape[-2] % 16 == 0 and mat_b.shape[-1] % 16 == 0, (mat_a.shape, mat_b.shape)
            assert mat_a.shape[-1] == mat_b.shape[-2], "contraction dimensions differ"
            # ... row-wise scales: float32, [rows] for the 2-D operand, [groups, N] for the 3-D one ...
            assert scale_a.dtype == scale_b.dtype == torch.float32
            assert scale_a.dim() == 1 and scale_a.is_contiguous() and scale_a.shape[0] == mat_a.shape[0]
            assert scale_b.dim() == 2 and scale_b.stride(-1) == 1 and tuple(scale_b.shape) == (mat_b.shape[0], mat_b.shape[-1])
            # ... int32 offsets, bfloat16 out, no bias.
            assert offs.dtype == torch.int32 and offs.dim() == 1 and out_dtype in (None, torch.bfloat16) and bias is None
            assert _leading_stride_ok(mat_a) and _leading_stride_ok(mat_b)
            self.scaled.append((tuple(mat_a.shape), tuple(mat_b.shape), scale_a.shape, scale_b.shape))
            return scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch, "_grouped_mm", checked_grouped)
            patch.setattr(torch, "_scaled_grouped_mm", checked_scaled)
            yield self


_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__index__}


class HostReads(TorchFunctionMode):
    """Answers host reads of tensors (`bool(t)`, `.item()`, `.tolist()`, ...) with True / 1 and
    counts them, for code that may read device data on the host: the eager mixed step reads its
    canvases' finished flags, and every answer says that no canvas finished (the branch nearly
    every step takes). Outside this mode every host read of a fake tensor raises
    DataDependentOutputException."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            t = args[0]
            self.reads.append(f"{func.__name__} of {tuple(t.shape)} {t.dtype} on {t.device}")
            value = True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
            return [value] * t.numel() if func is torch.Tensor.tolist else value
        return func(*args, **(kwargs or {}))


class NoHostReads(TorchFunctionMode):
    """Inside it, a host read raises as it does with no HostReads around, and so does a copy from
    the device to the host (`.cpu()`, `.to("cpu")`, `copy_` into a CPU tensor), a sync that the fake
    mode lets pass: what a step that CUDA graphs capture must not do."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            raise DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)
        if func in (torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.numpy):
            src = args[1] if func is torch.Tensor.copy_ else args[0]
            if func is torch.Tensor.copy_:
                to_host = args[0].device.type == "cpu"
            elif func is torch.Tensor.to:
                device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
                to_host = device is not None and torch.device(device).type == "cpu"
            else:
                to_host = True
            if to_host and isinstance(src, torch.Tensor) and src.device.type != "cpu":
                raise DataDependentOutputException(torch.ops.aten._to_copy.default)
        return func(*args, **kwargs)
