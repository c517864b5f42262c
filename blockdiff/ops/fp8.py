"""FP8 (E4M3) arithmetic: quantizing tensors and `fp8_linear`, the product of FP8 weights.

Weights stay FP8 in memory with float32 scales, one per output row (a per-tensor scale is stored
repeated on its rows). Activations follow the checkpoint's scheme, as compressed-tensors defines it:
"dynamic" quantizes each token (row) with scale max|row| / 448, "static" with one stored scale,
None leaves them alone.

- CPU: the activations are quantized and dequantized in their own dtype, the weight is dequantized
  to that dtype for this one product, and `linear` (blockdiff/ops/matmul.py) runs it. The dequantized
  copy lives only during the product, so a layer's weights are never resident in full precision.
- CUDA with compute capability 8.9 or above, bfloat16 activations and FP8-aligned shapes:
  `torch._scaled_mm` with row-wise scales (activation scale per row, weight scale per column of
  the product), the activations quantized to FP8 on the fly. This branch follows PyTorch's
  documented API but has not run on hardware yet (docs/fp8.md).
- Experts on CUDA 9.x / 10.x: `scaled_grouped_linear`, every expert in one `torch._scaled_grouped_mm`
  with the same row-wise scales (blockdiff/ops/kernels.py decides where; not yet run on hardware either).
"""

from __future__ import annotations

import functools

import torch

from blockdiff.ops.kernels import FP8
from blockdiff.ops.matmul import linear

FP8_MAX = torch.finfo(FP8).max


def quantize_rows(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] -> (FP8 weight, scale [..., out, 1] per channel or [1] per tensor), the scale
    in w's dtype as compressed-tensors stores it."""
    amax = w.abs().amax(dim=-1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
    scale = _nonzero(amax.float() / FP8_MAX).to(w.dtype)
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero row would divide by zero; compressed-tensors uses the dtype's eps there.
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded to FP8 under `scale` and back, in x's dtype."""
    scale = scale.to(x.dtype)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * scale


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token scales of x [..., features] -> [..., 1], in x's dtype."""
    return _nonzero(x.abs().amax(dim=-1, keepdim=True) / FP8_MAX)


def sharded_token_scales(x: torch.Tensor, group) -> torch.Tensor:
    """Per-token scales of rows split over the ranks of `group` by columns: the max over ranks,
    so that every rank rounds its slice exactly as one device rounds the whole row."""
    scales = token_scales(x)
    group.all_reduce(scales, "max")
    return scales


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    activations: str | None,
    input_scale: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., in] @ (weight [out, in] FP8 * scale [out, 1]).T, activations per the scheme.
    `x_scales`: dynamic per-token scales computed by the caller (over the whole row when x is one
    rank's slice of it)."""
    if x.is_cuda and activations is not None and _scaled_mm_fits(x, weight):
        return _scaled_mm(x, weight, scale, activations, input_scale, x_scales)
    if activations == "dynamic":
        x = fake_quantize(x, token_scales(x) if x_scales is None else x_scales)
    elif activations == "static":
        x = fake_quantize(x, input_scale)
    return linear(x, weight.to(x.dtype) * scale.to(x.dtype))


@functools.lru_cache(maxsize=None)
def _fp8_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Row-wise scaled FP8 products need bfloat16 output and dimensions divisible by 16.
    out, inner = weight.shape
    return x.dtype == torch.bfloat16 and out % 16 == 0 and inner % 16 == 0 and _fp8_capable(x.device.index or 0)


def _activation_scales(rows: torch.Tensor, activations: str, input_scale, x_scales) -> torch.Tensor:
    """float32 [rows, 1] scales of the activations [rows, features] for the FP8 kernels."""
    if activations == "dynamic":
        return token_scales(rows.float()) if x_scales is None else x_scales.float().reshape(-1, 1)
    return input_scale.float().reshape(1, 1).expand(rows.shape[0], 1).contiguous()


def _to_fp8(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (rows.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _scaled_mm(x, weight, scale, activations: str, input_scale, x_scales) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    x_scale = _activation_scales(rows, activations, input_scale, x_scales)
    y = torch._scaled_mm(_to_fp8(rows, x_scale), weight.t(), scale_a=x_scale, scale_b=scale.float().reshape(1, -1),
                         out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def scaled_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    ends: torch.Tensor,
    activations: str,
    input_scale: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ends[g-1]:ends[g] of x [rows, in] (bfloat16) times (weight[g] [out, in] FP8 * scale[g]
    [out, 1]).T, as one `torch._scaled_grouped_mm` with row-wise scales: the activations quantized
    per row ("dynamic", or by `x_scales` when x is one rank's slice of its rows) or with the static
    input scale. CUDA compute capability 9.x / 10.x only (blockdiff/ops/kernels.py decides); `ends`
    int32 on x's device; rows past ends[-1] are left undefined. -> [rows, out] bfloat16."""
    x_scale = _activation_scales(x, activations, input_scale, x_scales)
    return torch._scaled_grouped_mm(_to_fp8(x, x_scale), weight.transpose(1, 2), x_scale.reshape(-1),
                                    scale.float().reshape(scale.shape[0], -1), offs=ends, out_dtype=torch.bfloat16)
