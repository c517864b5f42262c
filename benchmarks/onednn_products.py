"""Whole generations with blockdiff's products on oneDNN with each weight packed once (the CPU
default, ops/matmul.py) against the other kernel of the same dtype, alternating in one process:

- float32 (default): against MKL's sgemm and PyTorch's SDPA, on the 15.8M bench checkpoint
  (/tmp/bench15);
- bfloat16: against F.linear, which runs the same oneDNN kernel but reorders the weight on every
  call, on the 319M config of benchmarks/cpu_roofline.py (/tmp/cpu_roofline_319m, which that
  script makes).

The settings are those of `bench offline` (128-token prompts, 256 new tokens, 8 denoising steps
per canvas, EOS ignored). It prints the CPU's capability and both kernels' times.

    OMP_NUM_THREADS=1 python benchmarks/onednn_products.py BATCH [RUNS]
    python benchmarks/onednn_products.py BATCH [RUNS] --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import blockdiff.ops.matmul as matmul
from blockdiff import LLM, SamplingParams
from blockdiff.model.registry import load_config

# dtype -> (the switch in ops/matmul.py, the checkpoint, the other kernel's name)
SETUPS = {
    "float32": ("_ONEDNN_FP32", "/tmp/bench15", "MKL + SDPA"),
    "bfloat16": ("_ONEDNN_BF16", "/tmp/cpu_roofline_319m", "F.linear"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("batch", type=int)
    p.add_argument("runs", type=int, nargs="?", default=5)
    p.add_argument("--dtype", choices=list(SETUPS), default="float32")
    p.add_argument("--model", help="checkpoint (default: the dtype's, above)")
    args = p.parse_args()
    switch, model, other = SETUPS[args.dtype]
    vocab = load_config(args.model or model).vocab_size
    prompts = [torch.randint(3, vocab, (128,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.batch)]
    params = SamplingParams(max_tokens=256, max_denoising_steps=8, stability_threshold=8, ignore_eos=True, seed=0)
    packed = "oneDNN, packed"
    times: dict[str, list[float]] = {packed: [], other: []}
    default = getattr(matmul, switch)
    if not default:
        raise SystemExit(f"error: this torch has no oneDNN {args.dtype} kernel on this machine")
    tokens = {}
    with LLM(args.model or model, dtype=args.dtype) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        for _ in range(args.runs):
            for name, onednn in ((packed, True), (other, False)):
                setattr(matmul, switch, onednn)  # read at every product, so the switch takes effect at once
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
                tokens[name] = [o.token_ids for o in outs]
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.dtype}, batch {args.batch}, "
          f"torch threads {torch.get_num_threads()}")
    for name, values in times.items():
        print(f"{name:>14}: median {statistics.median(values):.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
    print(f"{other} / {packed} time: {statistics.median(times[other]) / statistics.median(times[packed]):.2f}; "
          f"the same tokens: {tokens[packed] == tokens[other]}")


if __name__ == "__main__":
    main()
