"""Same seed, same tokens alone and in a batch: 8 seeded requests (prompts of 9-128 tokens,
128 new tokens) generated one by one and then as one batch, in float32 with the grouped experts and
in bfloat16 with the grouped and the batched experts (forced through `moe.kernel_on`, whatever this
CPU would choose), on a cpu_roofline.py config. Prints how many requests got the same tokens.

    python benchmarks/cpu_batch_invariance.py 15m     # or 319m (a few minutes)
"""
import sys, torch
sys.path.insert(0, "benchmarks")
torch.set_num_threads(2)
import cpu_roofline as c
import blockdiff.model.moe as moe
from blockdiff import LLM, SamplingParams
from blockdiff.bench.datasets import random_token_prompts, special_token_ids
from blockdiff.model.registry import load_config
from blockdiff.ops.kernels import BATCHED, GROUPED
name = sys.argv[1]
path = c.checkpoint(name); config = load_config(path)
orig = moe.kernel_on
for dtype in ("float32", "bfloat16"):
    llm = LLM(path, dtype=dtype, device="cpu", max_num_seqs=8, max_model_len=256)
    prompts = random_token_prompts([128, 40, 77, 128, 9, 100, 128, 60], config.vocab_size, special_token_ids(config), seed=3)
    params = [SamplingParams(max_tokens=128, max_denoising_steps=8, ignore_eos=True, seed=100 + i) for i in range(8)]
    for kernel in ([GROUPED, BATCHED] if dtype == "bfloat16" else [GROUPED]):
        moe.kernel_on = (lambda *a, k=kernel: k)
        alone = [llm.generate([p], [sp], use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
        batch = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        same = [a == b for a, b in zip(alone, batch)]
        first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(alone, batch)]
        print(f"{name} {dtype} experts {kernel}: same tokens alone and in a batch of 8: {sum(same)}/8; first differing position {first}", flush=True)
    llm.shutdown()
