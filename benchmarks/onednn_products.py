"""Whole generations with blockdiff's float32 products on oneDNN (the CPU default, model/matmul.py)
against MKL's sgemm and PyTorch's SDPA, alternating in one process on the 15.8M bench checkpoint
(/tmp/bench15) with the settings of `bench offline` (128-token prompts, 256 new tokens, 8 denoising
steps per canvas, EOS ignored). It prints the CPU's capability and both engines' times.

    OMP_NUM_THREADS=1 python benchmarks/onednn_products.py BATCH [RUNS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import blockdiff.ops.matmul as matmul
from blockdiff import LLM, SamplingParams


def main() -> None:
    batch = int(sys.argv[1])
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    prompts = [torch.randint(3, 8000, (128,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(batch)]
    params = SamplingParams(max_tokens=256, max_denoising_steps=8, stability_threshold=8, ignore_eos=True, seed=0)
    times: dict[str, list[float]] = {"oneDNN": [], "MKL + SDPA": []}
    default = matmul._ONEDNN_FP32
    if not matmul._ONEDNN_AVAILABLE:
        raise SystemExit("error: this torch has no oneDNN float32 kernel on this machine")
    with LLM("/tmp/bench15") as llm:
        llm.generate(prompts, params, use_tqdm=False)
        for _ in range(runs):
            for name, onednn in (("oneDNN", True), ("MKL + SDPA", False)):
                matmul._ONEDNN_FP32 = onednn  # read at every product, so the switch takes effect at once
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, batch {batch}, "
          f"the engine's default here: {'oneDNN' if default else 'MKL + SDPA'}")
    for name, values in times.items():
        print(f"{name:>11}: median {statistics.median(values):.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
    print(f"MKL + SDPA / oneDNN time: {statistics.median(times['MKL + SDPA']) / statistics.median(times['oneDNN']):.2f}")


if __name__ == "__main__":
    main()
