"""A whole generate's peak memory at the real vocabulary, over one float32 logits tensor of the batch.

A random checkpoint (model/tiny.py) of vocabulary --vocab (262,144), canvas 256, hidden size 64, 2 layers and 4
experts, run by the real engine (`LLM.generate`) in --dtype on one thread: one warm-up generate of one prompt, then
one of --batch (8) prompts of 16 tokens with max_tokens=256, max_denoising_steps=3, stability_threshold=3,
ignore_eos=True, seed=0. Printed: the process's peak resident set during the second generate minus its resident set
just before it, in GiB and over one float32 logits tensor of the batch (batch x 256 x vocab x 4 B: 2 GiB at 8
canvases and 262,144), then the same peak per stage of the step.

A stage's peak is the highest resident set while it runs, over the same base, the highest of its calls: the
kernel's high-water mark (VmHWM), reset through /proc/self/clear_refs when a stage starts and read when it ends
(every reading is kept before a reset, so stages nest). The stages are wrappers put on the engine's classes in this
process once the warm-up has run: the forward up to the final norm, the LM head, the LM head with its softcap, the
sampler's step, the self-conditioning product, the host's reading of the step (`ModelRunner._finish`: logprobs,
results) and the whole step (`ModelRunner.execute`, which may run several denoising steps per launch).

The process keeps freed memory in its heap as the `blockdiff` commands do (tune_cpu_heap,
blockdiff/worker/cpu_heap.py); with --plain-heap it keeps glibc's defaults, which map and unmap blocks this large at
every allocation, so the resident set follows the live tensors: the stages' peaks say most there (in a heap that
keeps freed memory, the blocks of earlier steps are resident already).

    OMP_NUM_THREADS=1 python benchmarks/step_memory.py [--vocab 262144] [--batch 8] [--dtype float32|bfloat16]
        [--compile] [--plain-heap] [--logprobs K] [--sampler-memory-gb G] [--workdir DIR]

--vocab below the real one scales the sampler's default workspace with it (`scaled_workspace_gb`), so that the
figures keep their ratios; --sampler-memory-gb sets it. --logprobs K asks every request for K top logprobs (the
logprob path; one denoising step per launch then).
--compile compiles the step of canvases (EngineConfig.compile): minutes of compiling per shape on this CPU; the
stages inside a step are then one graph, and only the results and the whole step are measured.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile

import torch

from blockdiff import LLM, SamplingParams
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.tiny import TinySpec, make_tiny_model
from blockdiff.diffusion.vocab_parallel import VocabParallel, workspace_bytes
from blockdiff.parallel.layers import VocabParallelEmbedding
from blockdiff.worker.cpu_heap import resident_bytes, status_bytes
from blockdiff.worker.model_runner import ModelRunner
from sampler_memory import CANVAS, VOCAB

PROMPT = 16


class Peaks:
    """Peaks of the resident set over `base`, per stage: every reading of the high-water mark is kept
    before it is reset, so a stage's peak is the highest reading taken while it ran."""

    def __init__(self):
        self.readings: list[int] = []
        self.stages: dict[str, list[tuple[int, int]]] = {}  # label -> (peak, resident at entry) per call
        self.base = 0

    def read(self) -> int:
        self.readings.append(status_bytes("VmHWM"))  # the peak since the last reset
        return self.readings[-1]

    def reset(self) -> None:
        self.read()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark back to the resident set now

    def start(self) -> None:
        self.base = resident_bytes()
        self.reset()

    def peak(self, since: int = 0) -> int:
        return max(self.readings[since:] + [self.read()]) - self.base

    def wrap(self, cls: type, name: str, label: str) -> None:
        """cls.name measured as stage `label` from now on."""
        f = getattr(cls, name)

        @functools.wraps(f)
        def measured(*args, **kwargs):
            self.reset()
            first, entry = len(self.readings), resident_bytes() - self.base
            out = f(*args, **kwargs)
            self.stages.setdefault(label, []).append((self.peak(first), entry))
            return out

        setattr(cls, name, measured)


def checkpoint(vocab: int, workdir: str | None) -> str:
    """The benchmark's checkpoint at `vocab` in `workdir` (None: the system's temporary directory),
    made once and reused."""
    path = os.path.join(workdir or tempfile.gettempdir(), f"blockdiff-step-memory-{vocab}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, TinySpec(vocab_size=vocab, hidden_size=64, num_layers=2, num_experts=4,
                                       canvas_length=CANVAS, tokenizer=False))
    return path


def scaled_workspace_gb(vocab: int) -> float:
    """The sampler's default workspace at the real vocabulary, scaled to `vocab`: its tiles then
    hold as many positions as they would there, the same share of the logits."""
    return workspace_bytes(None, torch.device("cpu")) * min(1.0, vocab / VOCAB) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--plain-heap", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--sampler-memory-gb", type=float, default=None)
    p.add_argument("--workdir", default=None, help="where the checkpoint is made (default: the temporary directory)")
    args = p.parse_args()
    with LLM(checkpoint(args.vocab, args.workdir), dtype=args.dtype, device="cpu", max_num_seqs=args.batch,
             max_model_len=PROMPT + CANVAS, tune_cpu_heap=not args.plain_heap, compile=args.compile,
             sampler_memory_gb=args.sampler_memory_gb or scaled_workspace_gb(args.vocab)) as llm:
        report(llm, args)


def report(llm: LLM, args: argparse.Namespace) -> None:
    """The two generates, measured, and the figures printed."""
    gib = 2**30
    g = torch.Generator().manual_seed(0)
    prompts = [[2] + torch.randint(3, args.vocab, (PROMPT - 1,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=CANVAS, max_denoising_steps=3, stability_threshold=3, ignore_eos=True, seed=0,
                            logprobs=args.logprobs)
    llm.generate(prompts[:1], params, use_tqdm=False)
    peaks = Peaks()
    runner = llm.engine.executor.runner
    inside = ((DiffusionGemma, "backbone", "forward to the final norm"),
              (VocabParallelEmbedding, "logits", "LM head"),
              (DiffusionGemma, "logits", "LM head + softcap"),
              (type(runner.sampler), "step", "sampler step"),
              (VocabParallel, "soft_embed", "self-conditioning product"))
    # Compiled, the stages inside a step are one graph, which a wrapper reading /proc cannot enter.
    for cls, name, label in (() if args.compile else inside) + ((ModelRunner, "_finish", "results and logprobs"),
                                                                (ModelRunner, "execute", "whole step")):
        peaks.wrap(cls, name, label)
    peaks.start()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = peaks.peak()
    logits = args.batch * CANVAS * args.vocab * 4
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"vocabulary {args.vocab}, canvas {CANVAS}, {args.batch} prompts, {args.dtype}, compile {args.compile}, "
          f"heap {'glibc defaults' if args.plain_heap else 'keeps freed memory'}, steps per launch "
          f"{runner.steps_per_launch}, sampler workspace {runner.vocab.workspace_bytes / gib:.2f} GiB, torch threads "
          f"{torch.get_num_threads()}; {tokens} tokens generated")
    print(f"resident before the generate {peaks.base / gib:.2f} GiB; float32 logits of the batch {logits / gib:.2f} GiB")
    print(f"whole generate: peak growth {total / gib:.2f} GiB, {total / logits:.2f}x the logits")
    print(f"{'stage':28} {'calls':>5} {'peak GiB':>9} {'/ logits':>9} {'at entry GiB':>13}")
    for label, calls in peaks.stages.items():
        top, entry = max(calls)
        print(f"{label:28} {len(calls):5d} {top / gib:9.2f} {top / logits:9.2f} {entry / gib:13.2f}")


if __name__ == "__main__":
    main()
