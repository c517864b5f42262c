"""blockdiff and transformers on the CPU as fractions of the machine's matmul peak, in
float32 and bfloat16, at batch 1 and 4, side by side: each side in a process of its own with 2
threads (the same torch), runs alternating so that load on the machine hits both sides alike.
In one process the two sides slowed each other: blockdiff's bfloat16 batch-4 generate took 6.5-7.1 s
alternating with transformers' and 5.8-6.1 s alone, with no page faults either way.

The peak is measured in the same run, just before each dtype's timings: the best of blockdiff's
`linear` and torch.mm on a 2048 x 2048 x 2048 product (blockdiff/bench/roofline.py measure_peak),
printed with the copy bandwidth of a 64 MB tensor. Each row gives the bound of the batch's generate
and which resource binds it (below), then per side the median of the timed runs, its fraction of
peak and its fraction of the bound, each with that of the fastest run in brackets: on a shared
machine other tenants' memory traffic slows the batch-1 bfloat16 generate (which streams every
expert's weights each step) by up to a third from one minute to the next, on both sides alike.

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

The bound (roofline.bound over roofline.generate_costs) is the least time blockdiff's engine steps
can take: the batch in lockstep, one prefill step, each canvas's denoising steps, one commit per
canvas but the last; each step takes at least the longer of its FLOPs at the matmul peak and its
compulsory bytes at the copy bandwidth, those bytes being the weights it touches (once per step,
the experts its tokens route to), the KV cache it reads and writes, and its float32 logits (canvas
tokens x vocabulary x 4 bytes, written and read back). The bytes bind where a step's weights are
large against the rows it multiplies them by (a large model at batch 1); the fraction of the bound
is the bound over the measured time. transformers' runs are set against the same bound.

Configs: "319m" (hidden 1024, 8 layers, 7 sliding + 1 full, 8 heads of 128, global head_dim 256,
32 experts top-4 of width 256, dense width 2048, vocabulary 32,768) and "15m" (the 15.8M bench
checkpoint of docs/benchmarks.md); random bfloat16 checkpoints made by model/tiny.py under /tmp.
The workload: 128-token prompts, 128 new tokens in 64-token canvases of 8 denoising steps (no
canvas stops early: stability_threshold = steps, no EOS). blockdiff's process keeps freed memory in
the heap as the `blockdiff` commands do (worker/cpu_heap.py) unless --no-tune-cpu-heap;
transformers' runs with glibc's defaults.

    python benchmarks/cpu_roofline.py                      # both configs, 3 timed runs each
    python benchmarks/cpu_roofline.py --configs 15m --iters 1 --batches 1
    python benchmarks/cpu_roofline.py --configs 319m --dtypes bfloat16 --torch-experts   # the expert kernels
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch

from blockdiff.bench.datasets import random_token_prompts, special_token_ids
from blockdiff.bench.roofline import bound, generate_costs, measure_peak, parameter_count, sequence_flops
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


TORCH_EXPERTS = "blockdiff-torch-experts"


def checkpoint(name: str) -> str:
    path = f"/tmp/cpu_roofline_{name}"
    if not os.path.isdir(path):
        make_tiny_model(path, TinySpec(**CONFIGS[name], dtype="bfloat16"))
    return path


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _side(conn, side: str, path: str, dtype_name: str, args: argparse.Namespace, max_batch: int) -> None:
    """One side's process: loads its model, then times one generate per batch size it is sent
    (None ends it) and sends back the seconds."""
    torch.set_num_threads(args.threads)
    config = load_config(path)
    if side == TORCH_EXPERTS:  # blockdiff with torch's grouped kernel for the experts, in its [in, out] layout
        from blockdiff.ops import cpu_grouped

        cpu_grouped.extension = lambda: None
    if side.startswith("blockdiff"):
        from blockdiff import LLM, SamplingParams

        llm = LLM(path, dtype=dtype_name, device="cpu", max_num_seqs=max_batch,
                  max_model_len=args.input_len + args.output_len, tune_cpu_heap=not args.no_tune_cpu_heap)
    else:
        from blockdiff.bench.reference import TransformersRunner

        reference = TransformersRunner(path, getattr(torch, dtype_name), "cpu", args.output_len, args.steps)
    conn.send("ready")
    while (batch := conn.recv()) is not None:
        prompts = random_token_prompts([args.input_len] * batch, config.vocab_size, special_token_ids(config), seed=batch)
        start = time.perf_counter()
        if side.startswith("blockdiff"):
            params = [SamplingParams(max_tokens=args.output_len, max_denoising_steps=args.steps,
                                     stability_threshold=args.steps, ignore_eos=True, seed=i) for i in range(batch)]
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [len(o.token_ids) for o in outs] == [args.output_len] * batch
        else:
            reference.generate(prompts, seed=0)
        conn.send(time.perf_counter() - start)
    if side.startswith("blockdiff"):
        llm.shutdown()


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
    p.add_argument("--torch-experts", action="store_true",
                   help=f"a third side, {TORCH_EXPERTS}: blockdiff with torch's grouped kernel for the experts where "
                        "blockdiff's AVX512-BF16 one would run (ops/cpu_grouped.py), side by side with it")
    p.add_argument("--no-tune-cpu-heap", action="store_true",
                   help="leave glibc's heap as it is in blockdiff's process (the blockdiff commands tune it: "
                        "worker/cpu_heap.py)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # Inherited by both sides' processes: the engine honours it where it would take one thread for a
    # small hidden size (engine/startup.py choose_threads), so every side and the peak use --threads.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    spawn = multiprocessing.get_context("spawn")

    print(f"threads {args.threads}, torch {torch.__version__}, load {loadavg()} at start")
    summary = []
    for name in args.configs.split(","):
        path = checkpoint(name)
        config = load_config(path)
        flops = sequence_flops(config, args.input_len, args.output_len, args.steps)
        print(f"\n{name}: {parameter_count(config) / 1e6:.1f}M parameters, {flops / 1e9:.1f} GFLOP per sequence")
        gen_s = {}
        for dtype_name in args.dtypes.split(","):
            sides = {}
            for side in (["blockdiff"] + ([TORCH_EXPERTS] if args.torch_experts else [])
                         + ([] if args.no_transformers else ["transformers"])):
                ours, theirs = spawn.Pipe()
                proc = spawn.Process(target=_side, args=(theirs, side, path, dtype_name, args, max(batches)))
                proc.start()
                assert ours.recv() == "ready"
                sides[side] = (ours, proc)
            peak = measure_peak("cpu", getattr(torch, dtype_name), size=2048)  # the sides wait meanwhile
            print(f"  {dtype_name}: peak {peak.gflops:.0f} GFLOP/s ({peak.kernel}, 2048^3), copy {peak.bandwidth_gbs:.0f} GB/s, "
                  f"load {loadavg()}")

            def run(side: str, batch: int) -> float:
                sides[side][0].send(batch)
                return sides[side][0].recv()

            for batch in batches:
                for side in sides:
                    run(side, batch)  # warmup
                times = {side: [] for side in sides}
                for _ in range(args.iters):
                    for side in sides:
                        times[side].append(run(side, batch))
                med = {k: statistics.median(v) for k, v in times.items()}
                gen_s[dtype_name, batch] = med["blockdiff"]
                costs = generate_costs(config, batch, args.input_len, args.output_len, args.steps,
                                       torch.tensor([], dtype=getattr(torch, dtype_name)).element_size())
                limit = bound(costs, peak.bandwidth_gbs, peak.gflops)
                parts = []
                for k, s in med.items():
                    rate = flops * batch / s / 1e9
                    best = flops * batch / min(times[k]) / 1e9
                    parts.append(f"{k} {s:7.2f} s {rate:6.1f} GFLOP/s {rate / peak.gflops:6.1%} of peak "
                                 f"(best run {best / peak.gflops:.1%}) {limit.fraction(s):6.1%} of bound "
                                 f"(best run {limit.fraction(min(times[k])):.1%})")
                speed = f", speedup {med['transformers'] / med['blockdiff']:.2f}x" if "transformers" in med else ""
                if TORCH_EXPERTS in med:
                    speed += f", blockdiff's expert kernel {med[TORCH_EXPERTS] / med['blockdiff']:.2f}x torch's"
                line = (f"{name} {dtype_name:8} batch {batch}: bound {limit.seconds:.3f} s ({limit.limit}) | "
                        + " | ".join(parts) + speed + f" (load {loadavg()})")
                print("  " + line, flush=True)
                summary.append(line)
            for conn, proc in sides.values():
                conn.send(None)
                proc.join()
        for batch in batches:
            if ("float32", batch) in gen_s and ("bfloat16", batch) in gen_s:
                line = (f"{name} batch {batch}: blockdiff bfloat16 generate {gen_s['float32', batch] / gen_s['bfloat16', batch]:.2f}x "
                        "faster than float32")
                print("  " + line)
                summary.append(line)
    print(f"\nload {loadavg()} at the end\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
