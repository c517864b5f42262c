"""blockdiff and transformers on the CPU as fractions of the machine's matmul peak (issue 41), in
float32 and bfloat16, at batch 1 and 4, side by side in one process: 2 threads each (the same
torch), runs alternating so that load on the machine hits both sides alike.

The peak is measured in the same run, just before each dtype's timings: the best of blockdiff's
`linear` and torch.mm on a 2048 x 2048 x 2048 product (blockdiff/bench/roofline.py measure_peak).

The useful FLOPs of one sequence (the same count for both sides; roofline.sequence_flops):

    2 x active parameters x tokens      every token through every layer's attention projections,
                                         dense MLP, router and its top-k experts (roofline.plan_cost):
                                         the prompt once, each canvas once per denoising step, and
                                         each committed canvas once more (the encoder's pass over it)
  + LM head                              2 x hidden x vocabulary per canvas token and step
  + self-conditioning product            the soft embedding (2 x vocabulary x hidden per canvas
                                         token of each step that has a next one) and the
                                         self-conditioning MLP (2 x 3 x hidden x dense width per
                                         canvas token of each step after the first)
  + attention                            4 x heads x head_dim per query-key pair a query may see

Configs: "319m" (hidden 1024, 8 layers, 7 sliding + 1 full, 8 heads of 128, global head_dim 256,
32 experts top-4 of width 256, dense width 2048, vocabulary 32,768) and "15m" (the 15.8M bench
checkpoint of docs/benchmarks.md); random bfloat16 checkpoints made by model/tiny.py under /tmp.
The workload: 128-token prompts, 128 new tokens in 64-token canvases of 8 denoising steps (no
canvas stops early: stability_threshold = steps, no EOS). The engine keeps freed memory in the heap
as the `blockdiff` commands do (worker/cpu_heap.py; process-wide, so for both sides) unless
--no-tune-cpu-heap.

    python benchmarks/cpu_roofline.py                      # both configs, 3 timed runs each
    python benchmarks/cpu_roofline.py --configs 15m --iters 1 --batches 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from blockdiff.bench.datasets import random_token_prompts, special_token_ids
from blockdiff.bench.roofline import measure_peak, parameter_count, sequence_flops
from blockdiff.model.registry import load_config
from blockdiff.model.tiny import TinySpec, make_tiny_model

CONFIGS = {
    "319m": dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_layers=8, num_heads=8,
                 num_kv_heads=4, head_dim=128, global_head_dim=256, num_global_kv_heads=2, num_experts=32,
                 top_k_experts=4, moe_intermediate_size=256, sliding_window=512, canvas_length=64,
                 layer_types=["sliding_attention"] * 7 + ["full_attention"]),
    "15m": dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4, num_kv_heads=2,
                head_dim=64, global_head_dim=128, num_global_kv_heads=1, num_experts=16, top_k_experts=4,
                moe_intermediate_size=128, sliding_window=512, canvas_length=64),
}


def checkpoint(name: str) -> str:
    path = f"/tmp/cpu_roofline_{name}"
    if not os.path.isdir(path):
        make_tiny_model(path, TinySpec(**CONFIGS[name], dtype="bfloat16"))
    return path


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="319m,15m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--iters", type=int, default=3, help="timed runs per side (after one warmup each)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--no-transformers", action="store_true", help="blockdiff only")
    p.add_argument("--no-tune-cpu-heap", action="store_true",
                   help="leave glibc's heap as it is (the blockdiff commands tune it: worker/cpu_heap.py; the "
                        "setting is process-wide, so transformers' side runs with it too)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from blockdiff import LLM, SamplingParams

    print(f"threads {args.threads}, torch {torch.__version__}, load {loadavg()} at start")
    summary = []
    for name in args.configs.split(","):
        path = checkpoint(name)
        config = load_config(path)
        flops = sequence_flops(config, args.input_len, args.output_len, args.steps)
        print(f"\n{name}: {parameter_count(config) / 1e6:.1f}M parameters, {flops / 1e9:.1f} GFLOP per sequence")
        gen_s = {}
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            llm = LLM(path, dtype=dtype_name, device="cpu", max_num_seqs=max(map(int, args.batches.split(","))),
                      max_model_len=args.input_len + args.output_len, tune_cpu_heap=not args.no_tune_cpu_heap)
            reference = None
            if not args.no_transformers:
                from blockdiff.bench.reference import TransformersRunner
                reference = TransformersRunner(path, dtype, "cpu", args.output_len, args.steps)
            peak = measure_peak("cpu", dtype, size=2048)
            print(f"  {dtype_name}: peak {peak.gflops:.0f} GFLOP/s ({peak.kernel}, 2048^3), load {loadavg()}")
            for batch in map(int, args.batches.split(",")):
                prompts = random_token_prompts([args.input_len] * batch, config.vocab_size, special_token_ids(config), seed=batch)
                params = [SamplingParams(max_tokens=args.output_len, max_denoising_steps=args.steps,
                                         stability_threshold=args.steps, ignore_eos=True, seed=i) for i in range(batch)]

                def ours() -> float:
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    assert [len(o.token_ids) for o in outs] == [args.output_len] * batch
                    return time.perf_counter() - t

                sides = {"blockdiff": ours}
                if reference:
                    sides["transformers"] = lambda: reference.generate(prompts, seed=0)
                for side in sides.values():
                    side()
                times = {k: [] for k in sides}
                for _ in range(args.iters):
                    for k, side in sides.items():
                        times[k].append(side())
                med = {k: statistics.median(v) for k, v in times.items()}
                gen_s[dtype_name, batch] = med["blockdiff"]
                parts = []
                for k, s in med.items():
                    rate = flops * batch / s / 1e9
                    parts.append(f"{k} {s:7.2f} s {rate:6.1f} GFLOP/s {rate / peak.gflops:6.1%} of peak")
                speed = f", speedup {med['transformers'] / med['blockdiff']:.2f}x" if reference else ""
                line = f"{name} {dtype_name:8} batch {batch}: " + " | ".join(parts) + speed + f" (load {loadavg()})"
                print("  " + line, flush=True)
                summary.append(line)
            llm.shutdown()
            del llm, reference
        for batch in map(int, args.batches.split(",")):
            if ("float32", batch) in gen_s and ("bfloat16", batch) in gen_s:
                line = (f"{name} batch {batch}: blockdiff bfloat16 generate {gen_s['float32', batch] / gen_s['bfloat16', batch]:.2f}x "
                        "faster than float32")
                print("  " + line)
                summary.append(line)
    print(f"\nload {loadavg()} at the end\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
