"""The engine with compiled static steps (--compile) against the eager engine, on the 15.8M bench
checkpoint of docs/benchmarks.md (/tmp/bench15): a batch of B 128-token prompts, one 64-token
canvas of 8 denoising steps each (8 of the 10 forwards are static steps). One warmup generate per
engine (the compile happens there), then 5 alternating timed generates, medians.

    OMP_NUM_THREADS=1 python benchmarks/compiled_step.py B
"""
import sys, time, torch
from blockdiff import LLM, SamplingParams
B = int(sys.argv[1])
prompts = [torch.randint(3, 8000, (128,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(B)]
p = SamplingParams(max_tokens=64, max_denoising_steps=8, stability_threshold=8, ignore_eos=True, seed=0)
llms = {"eager": LLM("/tmp/bench15", compile=False), "compiled": LLM("/tmp/bench15", compile=True)}
out = {}
for name, llm in llms.items():
    t = time.perf_counter(); out[name] = [o.token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    print(f"warmup {name}: {time.perf_counter() - t:.1f} s", flush=True)
print("same tokens:", out["eager"] == out["compiled"], flush=True)
ts = {k: [] for k in llms}
for _ in range(5):
    for name, llm in llms.items():
        t = time.perf_counter(); llm.generate(prompts, p, use_tqdm=False); ts[name].append(time.perf_counter() - t)
e, c = sorted(ts["eager"])[2], sorted(ts["compiled"])[2]
print(f"batch {B}: eager {e:.3f} s, compiled {c:.3f} s, eager/compiled {e / c:.2f}x; runs {ts}")
