"""What tensor parallelism costs on one device: ours against plain torch, side by side in one run.

(a) The self-conditioning helper `soft_embedding(P, W, scale)` at one rank against a bare `P @ W`,
    at DiffusionGemma-like shapes: a 256-token canvas, vocabularies from 32k to 262k, hidden sizes
    up to 2816 (scaled so that each product fits this machine's memory and time).
(b) One whole denoising step (decoder forward, sampler, self-conditioning) of a `ModelRunner` on a
    model built from the parallel layers, against the same runner on the same model with every
    parallel layer swapped for a plain linear layer / `nn.Embedding` sharing the same weights and
    the same matmul kernel (blockdiff/ops/matmul.py), and the sampler's and the helper's single-device
    arithmetic without any group logic (`PlainSampler` says what of it is written out here and what
    is inherited); and, as the measurement's noise floor, against a second identical runner of our own.

Repetitions alternate between the two sides; printed are the medians and their ratio (ours / plain;
1.00 = no cost), and the median of each round's ratio. Both sides must also produce the same
tokens, which the script checks.

    python benchmarks/tp_single_device_cost.py [--reps 7] [--threads 1] [--shapes 32768x2816,131072x1024,262144x512]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

import blockdiff.model.diffusion_gemma as diffusion_gemma
from blockdiff.diffusion.entropy_bound import DenoiseParams, EntropyBound, denoise_params
from blockdiff.parallel.self_conditioning import soft_embedding
from blockdiff.diffusion.vocab_parallel import Distribution, Draw, VocabParallel, exp_statistics, first_argmax, inverse_cdf, per_chunk
from blockdiff.sampling_params import REFERENCE_DEFAULTS, SamplingParams
from blockdiff.step import CacheConfig, NewRequests, StepPlan, StepRow, TableDelta
from blockdiff.worker.model_runner import ModelRunner
from blockdiff.ops.matmul import linear
from blockdiff.model.loader import load_model
from blockdiff.model.tiny import TinySpec, make_tiny_model
from blockdiff.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from blockdiff.parallel.vocab import VocabShard

CANVAS = 256


def interleaved(ours: Callable, plain: Callable, reps: int, names: tuple[str, str] = ("ours", "plain")) -> str:
    """Both sides alternating (their order flipping) each round; -> medians and two ratios: of the
    medians, and the median of the rounds' own ratios (robust to the machine's load drifting)."""
    times: dict[Callable, list[float]] = {ours: [], plain: []}
    for i in range(reps):
        for fn in (ours, plain) if i % 2 == 0 else (plain, ours):
            t0 = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - t0)
    a, b = times[ours], times[plain]
    return (
        f"{names[0]} {statistics.median(a) * 1e3:8.2f} ms  {names[1]} {statistics.median(b) * 1e3:8.2f} ms  "
        f"ratio {statistics.median(a) / statistics.median(b):.3f}  "
        f"(median of per-round ratios {statistics.median(x / y for x, y in zip(a, b)):.3f})"
    )


# ---- (a) the helper -------------------------------------------------------------------------
def helper_vs_matmul(vocab: int, hidden: int, reps: int, dtype: torch.dtype) -> str:
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(CANVAS, vocab, generator=g), dim=-1).to(dtype)
    weight = torch.randn(vocab, hidden, generator=g).to(dtype)
    scale = float(torch.tensor(hidden**0.5).to(dtype))
    ours, bare = (lambda: soft_embedding(probs, weight, scale)), (lambda: linear(probs, weight.t()))
    ours(), bare()  # warm-up
    return interleaved(ours, bare, reps, ("helper", "bare"))


# ---- (b) a whole step -----------------------------------------------------------------------
class PlainEmbedding(nn.Embedding):
    """nn.Embedding with the embedding scale, and the tied LM head."""

    def __init__(self, weight: torch.Tensor, scale: float):
        super().__init__(*weight.shape, _weight=weight, _freeze=True)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)


class PlainLinear(nn.Module):
    """A bias-free linear layer on the engine's matmul kernel (blockdiff/ops/matmul.py), so both sides
    differ only in the parallel layers' own logic."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class PlainSampler(VocabParallel):
    """The sampler's single-device arithmetic without the padding mask, the shard's index logic or
    the group, so that only the TP machinery differs between the two sides. Written out here from
    the same functions (blockdiff/diffusion/vocab_parallel.py): what the measured step runs
    (`distribution`, `argmax_and_sample`) and `token_logprob`. Inherited as they are, with no
    group (`sharded` False, `_global_sum` the identity): `tile_positions` and `soft_embed`, which
    hold no TP logic, only the workspace's tiling; `restricted_draw` and `top_logprobs`, whose
    only TP logic is one `if self.sharded` branch, skipped at one rank by ours too."""

    def __init__(self, shard: VocabShard, workspace_bytes: int | None):
        # Not VocabParallel.__init__: no group, padding mask or global ids. The shard is kept for
        # its vocab_size, which the sampler reads.
        self.shard, self.workspace_bytes, self.sharded = shard, workspace_bytes, False

    def distribution(self, x: torch.Tensor) -> Distribution:
        chunk_max = per_chunk(x, torch.amax)
        m = chunk_max.amax(dim=-1, keepdim=True)
        y, cum, dot, probs = exp_statistics(x, m, self.exp_tile(x))  # the first tile's e kept, as ours
        total = cum[..., -1]
        return Distribution(y, chunk_max.sub_(m), cum, None, total, total.log() - dot / total, probs)

    def argmax_and_sample(self, d: Distribution, u: torch.Tensor, draw: Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cum, total, threshold = (d.chunk_cumsum, d.total, None) if draw is None else (draw.chunk_cumsum, draw.total, draw.threshold)
        return first_argmax(d.shifted, d.chunk_max), inverse_cdf(d.shifted, cum, u.to(total.dtype) * total, threshold)

    def _global_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def token_logprob(self, d: Distribution, ids: torch.Tensor) -> torch.Tensor:
        return d.shifted.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - d.log_total


def plain_model(model: nn.Module) -> nn.Module:
    """A copy of `model` sharing its weights, with plain torch layers in place of parallel ones."""
    plain = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})
    for module in list(plain.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (ColumnParallelLinear, RowParallelLinear)):
                setattr(module, name, PlainLinear(child.weight))
            elif isinstance(child, VocabParallelEmbedding):
                setattr(module, name, PlainEmbedding(child.weight, child.scale))
    return plain


@contextlib.contextmanager
def bare_soft_embedding():
    """The model's helper call replaced by the bare product and scale."""
    helper = diffusion_gemma.soft_embedding
    diffusion_gemma.soft_embedding = lambda probs, weight, scale, shard, group: linear(probs, weight.t()) * scale
    try:
        yield
    finally:
        diffusion_gemma.soft_embedding = helper


def step_plans(prompt: int, vocab: int, blocks: tuple[int, ...]) -> tuple[StepPlan, StepPlan, StepPlan]:
    """(prefill, a canvas's first step, a later step) for one request in slot 0. The later step
    sends the request again, so that every run of it is the same step n (the ranks count n down)."""
    g = torch.Generator().manual_seed(0)
    empty = torch.empty(0, CANVAS, dtype=torch.long)

    def denoise() -> DenoiseParams:
        params = EntropyBound().resolve(SamplingParams(max_denoising_steps=16), REFERENCE_DEFAULTS)
        return denoise_params([8], [params], [0])

    prefill = StepPlan([StepRow(0, prompt, False)], torch.randint(0, vocab, (prompt,), generator=g), [], empty, None,
                       tables=TableDelta.of([0], [(0, i, b) for i, b in enumerate(blocks)], [(0, i, b) for i, b in enumerate(blocks)]),
                       new_requests=NewRequests([0], [0], denoise()))
    decode = [StepRow(0, CANVAS, True)]
    first = StepPlan(decode, torch.empty(0, dtype=torch.long), [0], torch.randint(0, vocab, (1, CANVAS), generator=g),
                     denoise().options(), new_canvas_steps=[8], new_canvas_index=[0])
    later = StepPlan(decode, torch.empty(0, dtype=torch.long), [], empty, denoise().options(),
                     new_requests=NewRequests([0], [prompt], denoise()))
    return prefill, first, later


def whole_step(spec: TinySpec, prompt: int, reps: int) -> tuple[str, str]:
    """-> (ours against plain, ours against a second identical runner: the measurement's noise floor)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(make_tiny_model(tmp, spec))
    cache = CacheConfig(num_slots=1, num_blocks=-(-(prompt + CANVAS) // 16), block_size=16, max_model_len=prompt + CANVAS)
    ours, twin, plain = (ModelRunner(m, cache, "cpu", EntropyBound()) for m in (model, model, plain_model(model)))
    plain.vocab = PlainSampler(plain.vocab.shard, plain.vocab.workspace_bytes)
    prefill, first, later = step_plans(prompt, spec.vocab_size, tuple(range(cache.num_blocks)))

    def run_plain(plan: StepPlan):
        with bare_soft_embedding():
            return plain.execute(plan)

    outs = {}
    for name, run in (("ours", ours.execute), ("twin", twin.execute), ("plain", run_plain)):
        run(prefill)
        outs[name] = [run(first).tokens, run(later).tokens]
    if not all(torch.equal(a, b) for a, b in zip(outs["ours"], outs["plain"])):
        raise SystemExit("the two sides disagree: the comparison is void")
    return (
        interleaved(lambda: ours.execute(later), lambda: run_plain(later), reps),
        interleaved(lambda: ours.execute(later), lambda: twin.execute(later), reps, ("ours", "ours again")),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7, help="repetitions of each side (interleaved)")
    p.add_argument("--shapes", default="32768x2816,131072x1024,262144x512", help="vocab x hidden for (a); empty: skip (a)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--step-vocab", type=int, default=32768, help="vocabulary of the model of (b)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} interleaved repetitions, medians")

    print(f"(a) soft_embedding at one rank vs bare probs @ W, canvas {CANVAS}, {args.dtype}")
    for shape in filter(None, args.shapes.split(",")):
        vocab, hidden = map(int, shape.split("x"))
        print(f"    vocab {vocab:>6} hidden {hidden:>4}: {helper_vs_matmul(vocab, hidden, args.reps, dtype)}")

    spec = TinySpec(
        vocab_size=args.step_vocab, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8, num_kv_heads=2,
        head_dim=64, global_head_dim=128, num_global_kv_heads=1, num_experts=8, top_k_experts=2,
        moe_intermediate_size=256, sliding_window=128, canvas_length=CANVAS, tokenizer=False,
    )
    prompt = 128
    print(
        f"(b) one denoising step, parallel layers vs plain torch layers: vocab {spec.vocab_size}, hidden {spec.hidden_size}, "
        f"{spec.num_layers} layers, {spec.num_experts} experts top-{spec.top_k_experts}, canvas {CANVAS}, {prompt} cached tokens, float32"
    )
    against_plain, against_twin = whole_step(spec, prompt, args.reps)
    print(f"    vs plain layers:         {against_plain}")
    print(f"    vs itself (noise floor): {against_twin}")


if __name__ == "__main__":
    main()
