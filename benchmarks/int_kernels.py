"""Weight-only integer products against bfloat16's, per product, at the 319M config's shapes: which
kernel ops/intmm.py should take at how many rows (its FAST_ROWS).

For each weight shape (out x in) and row count it times the best of `--iters` runs of each of:
- bf16: blockdiff's `linear` on the bfloat16 weight (oneDNN where the CPU has bfloat16 kernels,
  else float32 with the weight widened a tile at a time: ops/matmul.py);
- int8 torch / int4 torch: torch's `_weight_int8pack_mm` (int8 per-channel) and
  `_weight_int4pack_mm_for_cpu` (int4, groups of 128, packed once);
- int8 tile / int4 tile: ops/intmm.py's dequantize-a-tile-and-multiply path;
and prints each as a multiple of bf16's speed (higher is faster).

    OMP_NUM_THREADS=1 python benchmarks/int_kernels.py --threads 1   # rows 1 8 16 32 64 128 256
    python benchmarks/int_kernels.py --rows 1,64
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from blockdiff.ops.intmm import INT4_GROUPS, INT8_ROWS, int_linear, torch_kernel_linear
from blockdiff.ops.matmul import linear

# 319M: dense gate_up and down, the q/k/v projection, one expert's gate_up and down
SHAPES = {"dense gate_up": (4096, 1024), "dense down": (1024, 2048), "qkv": (2048, 1024),
          "expert gate_up": (512, 1024), "expert down": (1024, 256)}
GROUP = 128


def best(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64,128,256")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("shape | rows | bf16 µs | int8 torch | int8 tile | int4 torch | int4 tile (× bf16's speed)")
    param = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731 (packed once, as the layers' are)
    for name, (out, inp) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        w = param(torch.randn(out, inp, generator=g).bfloat16())
        q8, s8 = param(torch.randint(-127, 128, (out, inp), generator=g, dtype=torch.int8)), param(torch.rand(out, 1))
        q4, s4 = param(torch.randint(-8, 8, (out, inp), generator=g, dtype=torch.int8)), param(torch.rand(out, inp // GROUP))
        one, grouped = [(0, out, None)], [(0, out, None)]  # aligned groups, as layers on one rank
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, inp, generator=g).bfloat16()
            fns = {
                "bf16": lambda: linear(x, w),
                "int8 torch": lambda: torch_kernel_linear(INT8_ROWS, x, q8, s8, None),
                "int8 tile": lambda: int_linear(x, q8, s8, None, one),
                "int4 torch": lambda: torch_kernel_linear(INT4_GROUPS, x, q4, s4, None),
                "int4 tile": lambda: int_linear(x, q4, s4, None, grouped),
            }
            t = {k: 0.0 for k in fns}
            for k, fn in fns.items():
                t[k] = best(fn, args.iters)
            base = t["bf16"]
            cells = " | ".join(f"{base / t[k]:.2f}×" for k in list(fns)[1:])
            print(f"{name} {out}x{inp} | {rows} | {base * 1e6:.0f} | {cells}", flush=True)


if __name__ == "__main__":
    main()
