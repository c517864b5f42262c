"""Where one generation's time goes, by PyTorch op: torch.profiler over one `LLM.generate` on the
15.8M bench checkpoint (/tmp/bench15) with the settings of `bench offline` (128-token prompts, 256
new tokens, 8 denoising steps per canvas, EOS ignored), after one warmup generate; the ops with the
most self CPU time.

    OMP_NUM_THREADS=1 python benchmarks/profile_generate.py BATCH [--compile]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from blockdiff import LLM, SamplingParams


def main() -> None:
    batch, compiled = int(sys.argv[1]), "--compile" in sys.argv[2:]
    prompts = [torch.randint(3, 8000, (128,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(batch)]
    params = SamplingParams(max_tokens=256, max_denoising_steps=8, stability_threshold=8, ignore_eos=True, seed=0)
    with LLM("/tmp/bench15", compile=compiled) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
