"""Generate wall time of two checkouts side by side, alternating runs (these machines are noisy):
16 demo prompts, 64 new tokens each, seeded, eager steps by default (--num-scheduler-steps 1, where
every step runs the step function unstaged), one thread.

    .venv/bin/python benchmarks/checkout_ratio.py --base /path/to/other/checkout [--runs 6] [--steps-per-launch K]

Prints each run, the medians and their ratio (this checkout / base)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

RUN = """
import time
from blockdiff import LLM, SamplingParams
prompts = [f"sort: {' '.join(str((i * 7 + j) % 10) for j in range(6))}" for i in range(16)]
with LLM(num_scheduler_steps=K) as llm:
    llm.generate(prompts[:2], SamplingParams(max_tokens=16, seed=0), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, [SamplingParams(max_tokens=64, seed=i, ignore_eos=True) for i in range(16)], use_tqdm=False)
    print(time.perf_counter() - t)
"""


def run(checkout: str, k: int) -> float:
    env = {**os.environ, "PYTHONPATH": checkout, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RUN.replace("K)", f"{k})")], cwd=checkout, env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--steps-per-launch", type=int, default=1)
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    times: dict[str, list[float]] = {"this": [], "base": []}
    for _ in range(args.runs):
        for name, checkout in (("base", args.base), ("this", here)):
            times[name].append(run(checkout, args.steps_per_launch))
            print(f"{name:5} {times[name][-1]:.3f} s", flush=True)
    this, base = statistics.median(times["this"]), statistics.median(times["base"])
    print(f"median this {this:.3f} s, base {base:.3f} s, ratio {this / base:.3f}")


if __name__ == "__main__":
    main()
