"""The bfloat16 experts' grouped products on the CPU: blockdiff's AVX512-BF16 kernel
(blockdiff/ops/cpu_grouped.py) against torch's grouped kernel, side by side, in GB/s of expert
weights read, beside the read bandwidth of the same bytes measured in the same run (a max over
them: one pass, nothing written).

The shapes are the 319M benchmark config's (docs/benchmarks.md, "The CPU in float32 and bfloat16"):
32 experts, hidden 1024, width 256, so gate_up is [32, 512, 1024] and down [32, 1024, 256], for 8
layers (256 MB of bfloat16, beyond the L3 cache, as a step reads them), each expert given ROWS rows.
torch's kernel reads the [in, out] layout blockdiff keeps for it (ops/kernels.py
transposed_layout), blockdiff's the checkpoint's [out, in]. Runs alternate; medians of --reps.

    python benchmarks/cpu_expert_kernel.py                  # rows 8, 16, 32 per expert, 2 threads
    python benchmarks/cpu_expert_kernel.py --rows 8 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdiff.ops import cpu_grouped

EXPERTS, LAYERS = 32, 8
PROJECTIONS = {"gate_up": (512, 1024), "down": (1024, 256)}  # (out, in)


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,16,32", help="rows per expert")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ext = cpu_grouped.extension()
    if ext is None:
        raise SystemExit("error: blockdiff's AVX512-BF16 expert kernel does not run on this CPU (see the log)")
    with open("/proc/loadavg") as f:
        print(f"threads {args.threads}, torch {torch.__version__}, load {' '.join(f.read().split()[:3])}")
    g = torch.Generator().manual_seed(0)
    for name, (n_out, n_in) in PROJECTIONS.items():
        w = torch.randn(LAYERS, EXPERTS, n_out, n_in, generator=g).bfloat16()
        w_in_out = w.transpose(2, 3).contiguous()  # torch's layout, [E, in, out] in memory
        gb = w.numel() * 2 / 1e9
        flat = w.view(torch.int16).view(-1)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(EXPERTS * rows, n_in, generator=g).bfloat16()
            ends = torch.arange(1, EXPERTS + 1, dtype=torch.int32) * rows
            ours = lambda: [ext.grouped_mm_bf16(x, w[layer], ends, None) for layer in range(LAYERS)]  # noqa: E731
            theirs = lambda: [torch._grouped_mm(x, w_in_out[layer], offs=ends)  # noqa: E731
                              for layer in range(LAYERS)]
            read = lambda: flat.max()  # noqa: E731
            t = {"blockdiff": [], "torch": [], "read": []}
            for _ in range(args.reps):  # alternating, so that other tenants' traffic hits all three alike
                t["blockdiff"].append(timed(ours, 1))
                t["torch"].append(timed(theirs, 1))
                t["read"].append(timed(read, 1))
            med = {k: statistics.median(v) for k, v in t.items()}
            flops = 2 * EXPERTS * rows * n_out * n_in * LAYERS / 1e9
            print(f"{name:7} [{EXPERTS}, {n_out}, {n_in}] x {LAYERS} layers, {rows:2} rows per expert: "
                  f"blockdiff {gb / med['blockdiff']:5.1f} GB/s ({flops / med['blockdiff']:4.0f} GFLOP/s) | "
                  f"torch {gb / med['torch']:5.1f} GB/s ({flops / med['torch']:4.0f} GFLOP/s) | read {gb / med['read']:5.1f} GB/s | "
                  f"blockdiff {med['torch'] / med['blockdiff']:.2f}x torch, {med['read'] / med['blockdiff']:.0%} of the read rate",
                  flush=True)


if __name__ == "__main__":
    main()
