"""bfloat16 against integer weight-only checkpoints (W8A16, W4A16, mixed) on the CPU: committed
tokens/s at batch 1 and 4, side by side in one run, with each side's peak RSS and checkpoint size.

The checkpoints: cpu_roofline.py's random bfloat16 checkpoint of a config, and `blockdiff quantize
--scheme ...` of it (groups of 128), made once under /tmp. Each scheme runs in a process of its own
(`LLM`, bfloat16 activations, `--threads` threads), the processes taking turns run by run so that
load on a shared machine hits every side alike; each figure is the median of `--iters` timed
generates after one warmup. The workload is cpu_roofline.py's: 128-token prompts, 128 new tokens in
64-token canvases of 8 denoising steps, no early stop. "tok/s" counts committed tokens (batch x
128 per generate). On random weights the quantized logits do not change the step count (it is fixed);
what a real model's adaptive stop does with quantized logits is not measured here.

    OMP_NUM_THREADS=2 python benchmarks/int_weights.py                 # 319m, batch 1 and 4, 3 runs
    OMP_NUM_THREADS=1 python benchmarks/int_weights.py --configs 15m --threads 1 --iters 1
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time

import cpu_roofline as c
import torch

from blockdiff.bench.datasets import random_token_prompts, special_token_ids
from blockdiff.model.registry import load_config

SCHEMES = ("bf16", "w8a16", "w4a16", "mixed")


def quantized(path: str, scheme: str) -> str:
    if scheme == "bf16":
        return path
    out = f"{path}_{scheme}"
    if not os.path.isdir(out):
        from blockdiff.model.quantize import quantize_checkpoint
        from blockdiff.model.quantize_int import IntWriter, int_config

        quantize_checkpoint(path, out, IntWriter(int_config(scheme, 128)))
    return out


def size_gb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")) / 1e9


def _side(conn, path: str, args: argparse.Namespace, max_batch: int) -> None:
    """One scheme's process: times one generate per batch size it is sent (None ends it)."""
    torch.set_num_threads(args.threads)
    from blockdiff import LLM, SamplingParams

    config = load_config(path)
    llm = LLM(path, dtype="bfloat16", device="cpu", max_num_seqs=max_batch, max_model_len=args.input_len + args.output_len)
    conn.send("ready")
    while (batch := conn.recv()) is not None:
        prompts = random_token_prompts([args.input_len] * batch, config.vocab_size, special_token_ids(config), seed=batch)
        params = [SamplingParams(max_tokens=args.output_len, max_denoising_steps=args.steps,
                                 stability_threshold=args.steps, ignore_eos=True, seed=i) for i in range(batch)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert [len(o.token_ids) for o in outs] == [args.output_len] * batch
        conn.send((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))
    llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="319m")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--batches", default="1,4")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    spawn = multiprocessing.get_context("spawn")
    print(f"threads {args.threads}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"load {c.loadavg()} at start")
    for name in args.configs.split(","):
        base = c.checkpoint(name)
        paths = {s: quantized(base, s) for s in args.schemes.split(",")}
        sides = {}
        for scheme, path in paths.items():
            ours, theirs = spawn.Pipe()
            proc = spawn.Process(target=_side, args=(theirs, path, args, max(batches)))
            proc.start()
            assert ours.recv() == "ready"
            sides[scheme] = (ours, proc)

        def run(scheme: str, batch: int) -> tuple[float, float]:
            sides[scheme][0].send(batch)
            return sides[scheme][0].recv()

        print(f"\n{name} | batch | " + " | ".join(f"{s} tok/s" for s in sides) + " | peak RSS GiB | checkpoint GB")
        for batch in batches:
            for scheme in sides:
                run(scheme, batch)  # warmup
            times, rss = {s: [] for s in sides}, {}
            for _ in range(args.iters):
                for scheme in sides:
                    seconds, rss[scheme] = run(scheme, batch)
                    times[scheme].append(seconds)
            rate = {s: batch * args.output_len / statistics.median(t) for s, t in times.items()}
            first = next(iter(sides))
            cells = " | ".join(f"{r:.1f} ({r / rate[first]:.2f}×)" for r in rate.values())
            print(f"{name} | {batch} | {cells} | " + " / ".join(f"{rss[s]:.2f}" for s in sides) + " | "
                  + " / ".join(f"{size_gb(paths[s]):.2f}" for s in sides) + f" (load {c.loadavg()})", flush=True)
        for conn, proc in sides.values():
            conn.send(None)
            proc.join()


if __name__ == "__main__":
    main()
