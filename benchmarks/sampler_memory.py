"""The sampler's peak memory and time against the logits' own size, before and after tiling.

One denoising step's sampler part at the real vocabulary (262,144) and canvas (256): the
distribution (max, exp statistics, entropy), argmax and the candidate draw, and the
self-conditioning probabilities multiplied by a float32 embedding of every canvas (the step where
no canvas ends). The memory runs use an embedding of width 16 (the product's width does not change
the probabilities' memory); the timing runs use the real 2816, whose product dominates the step.
Every process keeps freed memory in its heap as the `blockdiff` commands do
(blockdiff/worker/cpu_heap.py), so neither side pays page faults for its temporaries each step.

"before" is the sampler of commit 963f508 (blockdiff/diffusion/vocab_parallel.py read from git),
which keeps exp(x - max) beside the logits and builds Σ e·y in another full temporary; "tiled" is
the current one with its default workspace (or --sampler-memory-gb).

Memory: each variant runs once in its own process at --batch, which allocates and fills the
logits, then runs the step; the peak is the process's highest resident set (ru_maxrss) minus its
resident set with the logits in place. Time: one more process runs both variants alternately
--reps times at --time-batch (this machine is shared: alternating spreads the load over both), and
prints the median and the best of each.

    OMP_NUM_THREADS=1 python benchmarks/sampler_memory.py [--batch 16] [--time-batch 1] [--reps 5] [--sampler-memory-gb G]

--batch is lowered to the largest that fits in 85% of the available memory when the "before"
variant (about 3.2 copies of the logits) would not fit; the output says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

VOCAB, CANVAS, HIDDEN = 262_144, 256, 2816
BEFORE_REF = "963f508"  # the last commit with the untiled sampler
BEFORE_COPIES = 3.2  # logits, exp, Σe·y's temporary, plus the small statistics


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _before_module():
    source = subprocess.run(["git", "show", f"{BEFORE_REF}:blockdiff/diffusion/vocab_parallel.py"], check=True,
                            capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    path = os.path.join(tempfile.mkdtemp(), "vocab_parallel_before.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("vocab_parallel_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_variant(variant: str, batch: int, reps: int, memory_gb: float | None, hidden: int = 16) -> dict:
    """In a fresh process: the step `reps` times; peak resident memory over the logits, and times.
    variant "both": "before" and "tiled" alternately, times only."""
    if variant == "both":
        runs = [[run_variant(v, batch, 1, memory_gb, hidden)["seconds"] for v in ("before", "tiled")] for _ in range(reps)]
        return {"before": [r[0] for r in runs], "tiled": [r[1] for r in runs]}
    from blockdiff.diffusion import vocab_parallel as current
    from blockdiff.parallel.self_conditioning import soft_embedding
    from blockdiff.parallel.group import TPGroup
    from blockdiff.parallel.vocab import VocabShard
    from blockdiff.worker.cpu_heap import keep_freed_memory

    keep_freed_memory()
    shard = VocabShard.make(0, 1, VOCAB)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, hidden, generator=g)
    u = torch.rand(batch, CANVAS, generator=g)
    logits = torch.empty(batch, CANVAS, VOCAB)
    if variant == "before":
        vocab = _before_module().VocabParallel(shard, TPGroup())
    else:
        vocab = current.VocabParallel(shard, TPGroup(), workspace_bytes=current.workspace_bytes(memory_gb, torch.device("cpu")))

    def embed(probs: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        return soft_embedding(probs, weight, (1.0 / total).unsqueeze(-1))

    times, outputs, base = [], None, None
    for _ in range(reps):
        logits.normal_(generator=torch.Generator().manual_seed(1)).mul_(4)  # in place: the same logits every rep
        if base is None:
            base = _rss()
        t0 = time.perf_counter()
        d = vocab.distribution(logits)
        argmax, sample = vocab.argmax_and_sample(d, u)
        if variant == "before":
            soft = embed(d.exp, d.total)
        else:
            soft = vocab.soft_embed(d, None, embed, torch.float32)
        times.append(time.perf_counter() - t0)
        outputs = (d.entropy, argmax, sample, soft)
        del d
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logits_bytes = logits.numel() * 4
    return {
        "variant": variant, "batch": batch, "logits_bytes": logits_bytes, "extra_bytes": peak - base,
        "peak_over_logits": (logits_bytes + peak - base) / logits_bytes, "seconds": sorted(times)[len(times) // 2],
        "workspace_bytes": None if variant == "before" else vocab.workspace_bytes,
        "checksum": [float(outputs[0].double().sum()), int(outputs[1].sum()), int(outputs[2].sum()),
                     float(outputs[3].double().abs().sum())],
    }


def _available() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--time-batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sampler-memory-gb", type=float, default=None)
    p.add_argument("--hidden", type=int, default=16, help=argparse.SUPPRESS)  # the child's embedding width
    p.add_argument("--variant", choices=["before", "tiled", "both"], help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.batch, args.reps, args.sampler_memory_gb, args.hidden)))
        return
    per_canvas = CANVAS * VOCAB * 4
    fits = int(0.85 * _available() // (BEFORE_COPIES * per_canvas))
    batch = min(args.batch, fits)
    if batch < 1:
        sys.exit("error: not enough free memory for one canvas")
    if batch < args.batch:
        print(f"batch {args.batch} does not fit in 85% of the available memory: running batch {batch}")
    def child(variant: str, batch: int, reps: int, hidden: int = 16):
        cmd = [sys.executable, __file__, "--variant", variant, "--batch", str(batch), "--reps", str(reps), "--hidden", str(hidden)]
        if args.sampler_memory_gb is not None:
            cmd += ["--sampler-memory-gb", str(args.sampler_memory_gb)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    b, t = child("before", batch, 1), child("tiled", batch, 1)
    gib = 2**30
    print(f"vocabulary {VOCAB}, canvas {CANVAS}, batch {batch}: logits {b['logits_bytes'] / gib:.2f} GiB (float32), "
          f"tiled workspace {t['workspace_bytes'] / gib:.2f} GiB, torch threads {torch.get_num_threads()}")
    print(f"{'':8} {'extra GiB':>10} {'peak / logits':>14}")
    for r in (b, t):
        print(f"{r['variant']:8} {r['extra_bytes'] / gib:10.2f} {r['peak_over_logits']:14.2f}")
    print(f"tiled / before: peak {t['peak_over_logits'] / b['peak_over_logits']:.2f}x; "
          f"same entropy, argmax and draws: {b['checksum'][:3] == t['checksum'][:3]}")
    times = child("both", min(args.time_batch, batch), args.reps, HIDDEN)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"time per sampler step at batch {min(args.time_batch, batch)}, embedding width {HIDDEN}, {args.reps} alternating runs: "
          + ", ".join(f"{k} median {med[k]:.2f} s (best {min(v):.2f})" for k, v in times.items())
          + f"; tiled / before {med['tiled'] / med['before']:.2f}x")


if __name__ == "__main__":
    main()
