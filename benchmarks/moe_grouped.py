"""One MoE block's experts (`model.moe.Experts`) on the CPU: grouped products (torch._grouped_mm,
offsets on the device), two oneDNN/BLAS products per busy expert (the row counts read on the host)
and, in bfloat16, one torch.bmm per projection over every expert's rows padded to the busiest
expert's 16-row tiles (kernels.BATCHED, where the padding allows it; else grouped). Shapes: the
15.8M bench checkpoint's (16 experts top-4, hidden 256, width 128) and, with --big, cpu_roofline.py's 319M
config's (32 experts top-4, hidden 1024, width 256). Each call's tokens are routed at random. All
paths alternate in this one process; medians of 7 timings of 10 calls each.

    OMP_NUM_THREADS=1 python benchmarks/moe_grouped.py [--big] [--tokens 64,256]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from blockdiff.model.moe import Experts
from blockdiff.ops.kernels import BATCHED, GROUPED, PER_EXPERT
from blockdiff.parallel.group import TPGroup


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--big", action="store_true", help="the 319M config's experts (cpu_roofline.py's)")
    p.add_argument("--tokens", default="64,512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    torch.manual_seed(0)
    e, h, w, k = (32, 1024, 256, 4) if args.big else (16, 256, 128, 4)
    config = SimpleNamespace(num_experts=e, hidden_size=h, moe_intermediate_size=w, hidden_activation="gelu_pytorch_tanh")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        experts = Experts(config, TPGroup(), dtype)
        experts.gate_up.data.normal_(0, 0.05)
        experts.down.data.normal_(0, 0.05)
        modes = [PER_EXPERT, GROUPED] + ([BATCHED] if dtype == torch.bfloat16 else [])
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, h, dtype=dtype)
            index = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k)
            busiest = int(torch.bincount(index.reshape(-1), minlength=e).max())
            times, outs = {m: [] for m in modes}, {}
            with torch.inference_mode():
                for _ in range(7):
                    for mode in modes:
                        experts.kernel = lambda x, mode=mode: mode
                        outs[mode] = experts(x, weights, index)
                        start = time.perf_counter()
                        for _ in range(10):
                            experts(x, weights, index)
                        times[mode].append((time.perf_counter() - start) / 10 * 1e3)
            med = {m: sorted(t)[3] for m, t in times.items()}
            diff = max((outs[m].float() - outs[GROUPED].float()).abs().max().item() for m in modes)
            text = ", ".join(f"{m} {t:7.3f} ms" for m, t in med.items())
            ratio = f", grouped/batched {med[GROUPED] / med[BATCHED]:.2f}x" if BATCHED in med else ""
            print(f"{str(dtype)[6:]:9} {tokens:4} tokens (busiest expert {busiest:3} rows): {text}, "
                  f"per-expert/grouped {med[PER_EXPERT] / med[GROUPED]:.2f}x{ratio}, max difference {diff:.1e}")


if __name__ == "__main__":
    main()
