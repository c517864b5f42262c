"""The CPU kernel choices behind the CPU step's costs, each against the alternative it replaced,
side by side in one process (CPU time of this thread, median of 7 rounds), with the bit equality
that lets the choice keep every seeded output:

- oneDNN float32 products with the weight reordered once (`matmul._packed`) against a plain weight;
- the experts' grouped products with each weight in memory as [in, out] (`kernels.transposed_experts`)
  against a transposed view of the checkpoint's [out, in];
- attention's unseen keys: a 0 / -inf bias against a broadcast `masked_fill_`, and the -inf scores
  exponentiated as 0 and zeroed after against `exp` of -inf;
- torch's CPU `exp` on inputs inside and below float32's range (what greedy decoding feeds it),
  and the sampler's weights with the ones below that range taken as 0 (ops/sampler_weights.py)
  against `exp` of the same shifted logits: the last denoising step's temperature of 0.4 spreads
  them over [-150, 0], greedy decoding over [-1e6, 0]; at [-80, 0] nothing lies below the floor.

    OMP_NUM_THREADS=1 python benchmarks/cpu_kernels.py
"""

from __future__ import annotations

import time

import torch

from blockdiff.ops.matmul import _ONEDNN_FP32
from blockdiff.ops.sampler_weights import weights_exp


def cpu_us(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(7):
        start = time.thread_time()
        for _ in range(n):
            fn()
        rounds.append((time.thread_time() - start) / n * 1e6)
    return sorted(rounds)[3]


def row(name: str, old: float, new: float, same: bool | None = None) -> None:
    bits = "" if same is None else f"  same bits: {same}"
    print(f"{name:58s} {old:9.0f} {new:9.0f} {new / old:6.2f}x{bits}")


def products() -> None:
    dnn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    for m in (64, 512):
        for n, k in ((512, 256), (640, 256), (256, 256), (1024, 256), (256, 512), (8192, 256)):
            x, w = torch.randn(m, k), torch.randn(n, k)
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            row(f"linear [{m}, {k}] x [{n}, {k}]^T: plain -> packed weight", cpu_us(lambda: dnn(x, w)),
                cpu_us(lambda: dnn(x, packed)), torch.equal(dnn(x, w), dnn(x, packed)))


def experts() -> None:
    e, h, w = 16, 256, 128  # the 15.8M checkpoint: 16 experts of width 128, top 4
    for tokens in (64, 512):
        rows = (tokens * 4 + e * 7) // e // 8 * 8
        x, ends = torch.randn(rows * e, h), torch.arange(1, e + 1, dtype=torch.int32) * rows
        for name, out, inner in (("gate_up", 2 * w, h), ("down", h, w)):
            weight = torch.randn(e, out, inner)
            transposed = weight.transpose(1, 2).contiguous().transpose(1, 2)
            xs = x[:, :inner].contiguous()
            old = lambda: torch._grouped_mm(xs, weight.transpose(1, 2), offs=ends)  # noqa: E731
            new = lambda: torch._grouped_mm(xs, transposed.transpose(1, 2), offs=ends)  # noqa: E731
            row(f"experts {name}, {tokens} tokens: [out, in] -> [in, out] in memory", cpu_us(old), cpu_us(new),
                torch.equal(old(), new()))


def attention_mask() -> None:
    for shape, mask_shape in (((1, 1, 2, 4, 64, 256), (1, 1, 2, 1, 1, 256)), ((1, 8, 2, 4, 64, 256), (1, 8, 2, 1, 1, 256))):
        scores, work = torch.randn(shape), torch.empty(shape)
        seen = torch.rand(mask_shape) > 0.3
        bias = torch.where(seen, 0.0, float("-inf"))
        copy = cpu_us(lambda: work.copy_(scores))
        fill = lambda: work.copy_(scores).masked_fill_(~seen, float("-inf"))  # noqa: E731
        add = lambda: work.copy_(scores).add_(bias)  # noqa: E731
        row(f"unseen keys of scores {list(shape)}: masked_fill_ -> bias", cpu_us(fill) - copy, cpu_us(add) - copy,
            torch.equal(fill().clone(), add().clone()))
        masked = scores + bias
        plain = lambda: work.copy_(masked).exp_()  # noqa: E731
        zeroed = lambda: work.copy_(masked).nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0).exp_().mul_(seen)  # noqa: E731
        row(f"exp of scores {list(shape)}, 30% -inf: exp -> as 0, zeroed", cpu_us(plain) - copy, cpu_us(zeroed) - copy,
            torch.equal(plain().clone(), zeroed().clone()))


def exp_ranges() -> None:
    out = torch.empty(64, 8192)
    x = torch.empty(64, 8192).uniform_(-80, 0)
    inside = cpu_us(lambda: torch.exp(x, out=out))
    for lo, hi in ((-95, -88), (-120, -104)):
        y = torch.empty(64, 8192).uniform_(lo, hi)
        row(f"exp of [64, 8192] in [-80, 0] -> in [{lo}, {hi}]", inside, cpu_us(lambda: torch.exp(y, out=out)))
    for lo in (-80, -150, -1e6):  # -80: no weight below the floor, where the floor only costs
        y = torch.empty(64, 8192).uniform_(lo, 0)
        row(f"weights of [64, 8192] in [{lo:g}, 0]: exp -> floored", cpu_us(lambda: torch.exp(y, out=out)),
            cpu_us(lambda: weights_exp(y, out=out)))


if __name__ == "__main__":
    print(f"{'':58s} {'old us':>9s} {'new us':>9s} {'ratio':>7s}")
    if _ONEDNN_FP32:
        products()
    experts()
    attention_mask()
    exp_ranges()
