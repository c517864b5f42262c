"""One MoE block's experts (`model.moe.Experts`) on the CPU: grouped products (torch._grouped_mm,
offsets on the device) against two oneDNN/BLAS products per busy expert (the row counts read on the
host), at the 15.8M bench checkpoint's shapes (16 experts top-4, hidden 256, width 128), for a
canvas of 64 tokens and a batch of 8 canvases, float32 and bfloat16. Both paths alternate in this
one process; medians of 7 timings of 10 calls each.

    OMP_NUM_THREADS=1 python benchmarks/moe_grouped.py
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from blockdiff.model.moe import Experts
from blockdiff.parallel.group import TPGroup


def main() -> None:
    torch.manual_seed(0)
    config = SimpleNamespace(num_experts=16, hidden_size=256, moe_intermediate_size=128, hidden_activation="gelu_pytorch_tanh")
    for dtype in (torch.float32, torch.bfloat16):
        experts = Experts(config, TPGroup(), dtype)
        experts.gate_up.data.normal_(0, 0.05)
        experts.down.data.normal_(0, 0.05)
        for tokens in (64, 512):
            x = torch.randn(tokens, 256, dtype=dtype)
            index = torch.stack([torch.randperm(16)[:4] for _ in range(tokens)])
            weights = torch.rand(tokens, 4)
            times, outs = {"per-expert": [], "grouped": []}, {}
            with torch.inference_mode():
                for _ in range(7):
                    for mode in times:
                        experts.grouped = lambda x, grouped=mode == "grouped": grouped
                        outs[mode] = experts(x, weights, index)
                        start = time.perf_counter()
                        for _ in range(10):
                            experts(x, weights, index)
                        times[mode].append((time.perf_counter() - start) / 10 * 1e3)
            per, grouped = (sorted(t)[3] for t in times.values())
            diff = (outs["grouped"].float() - outs["per-expert"].float()).abs().max().item()
            print(f"{str(dtype)[6:]:9} {tokens:4} tokens: per-expert {per:7.3f} ms, grouped {grouped:7.3f} ms, "
                  f"per-expert/grouped {per / grouped:.2f}x, max difference {diff:.1e}")


if __name__ == "__main__":
    main()
