"""bfloat16 products on the CPU: torch's own against float32 products over weights widened a tile
at a time (blockdiff/ops/matmul.py `_float32_linear`, what `linear` runs where the CPU has no
bfloat16 kernels), side by side per shape, with the ratio. The shapes are the 15.8M bench
checkpoint's (hidden 256, vocabulary 8,192, expert width 128) at a 64-token canvas: a dense
projection, an expert's gate/up at 24 rows, the LM head, and the soft embedding (probabilities times
the [vocab, hidden] table read through a transposed view), then the 26B model's LM head at one
canvas row tile (hidden 2,816, vocabulary 262,144).

    OMP_NUM_THREADS=1 python benchmarks/bf16_products.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from blockdiff.ops.matmul import _float32_linear, bf16_products_widen

SHAPES = [  # (name, rows, out, in, weight read transposed)
    ("dense 64 x 256 -> 1024", 64, 1024, 256, False),
    ("expert 24 x 256 -> 256", 24, 256, 256, False),
    ("LM head 64 x 256 -> 8192", 64, 8192, 256, False),
    ("soft embedding 64 x 8192 -> 256", 64, 256, 8192, True),
    ("26B LM head 8 x 2816 -> 262144", 8, 262144, 2816, False),
]


def best_of(fn, seconds: float = 1.0) -> float:
    fn()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}; "
          f"linear widens bfloat16 here: {bf16_products_widen('cpu')}")
    print(f"{'product':34} {'torch bf16 ms':>14} {'widened ms':>11} {'torch / widened':>16}")
    g = torch.Generator().manual_seed(0)
    for name, rows, n_out, n_in, transposed in SHAPES:
        x = torch.randn(rows, n_in, generator=g).bfloat16()
        w = torch.randn(n_in, n_out, generator=g).bfloat16().t() if transposed else torch.randn(n_out, n_in, generator=g).bfloat16()
        plain = best_of(lambda: F.linear(x, w))
        widened = best_of(lambda: _float32_linear(x, w))
        print(f"{name:34} {plain * 1e3:14.2f} {widened * 1e3:11.2f} {plain / widened:15.2f}x")


if __name__ == "__main__":
    main()
