"""A model at the real DiffusionGemma-26B-A4B widths and vocabulary generating on this CPU.

configs/diffusiongemma-26b-a4b.json with dummy weights (`load_format="dummy"`: no checkpoint
file), bfloat16, the first --layers layers (`num_layers_override`), through the real engine
(`LLM.generate`): --batch prompts of --prompt tokens, one 256-token canvas each, --steps denoising
steps. Printed: the parameter bytes, the process's peak resident memory (ru_maxrss) and its
resident memory before the model, the logits' own size at this batch, and the time of the
generate call. One thread per the machine's rules: each step's LM head alone is
2 · batch · 256 · 262,144 · 2816 FLOPs (3 TFLOP at batch 8), so expect minutes.

    OMP_NUM_THREADS=1 python benchmarks/big_shapes.py [--layers 2] [--batch 8] [--steps 1] [--prompt 16]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

from blockdiff import LLM, SamplingParams
from blockdiff.demo import demo_checkpoint

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "diffusiongemma-26b-a4b.json")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--prompt", type=int, default=16)
    args = p.parse_args()
    gib = 2**30
    before = _rss()
    with LLM(CONFIG, load_format="dummy", dtype="bfloat16", device="cpu", tokenizer=demo_checkpoint(),
             num_layers_override=args.layers, max_num_seqs=args.batch, max_model_len=args.prompt + 256,
             tune_cpu_heap=True) as llm:
        model = llm.engine.executor.runner.model
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        loaded = _rss()
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.vocab_size
        prompts = [[2] + torch.randint(3, vocab, (args.prompt - 1,), generator=g).tolist() for _ in range(args.batch)]
        params = SamplingParams(max_tokens=256, max_denoising_steps=args.steps, ignore_eos=True, seed=0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    logits = args.batch * 256 * vocab * 4
    print(f"{args.layers} layers at the 26B-A4B widths, vocabulary {vocab}, bfloat16 dummy weights, batch {args.batch}, "
          f"{args.steps} denoising step(s), prompt {args.prompt} tokens, torch threads {torch.get_num_threads()}")
    print(f"parameters {weights / gib:.2f} GiB; resident before the model {before / gib:.2f} GiB, after loading "
          f"{loaded / gib:.2f} GiB, peak {peak / gib:.2f} GiB; float32 logits of one step {logits / gib:.2f} GiB")
    print(f"generated {sum(len(o.token_ids) for o in outs)} tokens in {seconds:.1f} s "
          f"({[len(o.token_ids) for o in outs]} per request)")


if __name__ == "__main__":
    main()
