"""Roofline: the arithmetic and memory traffic of a forward, from the config, against measured peaks.

`plan_cost` counts what one engine step must do for the rows it runs (a denoising step, a commit, a
prompt chunk): FLOPs of every matmul and of attention over the keys each query may see (masked-out
keys are not counted), and the bytes that must cross the memory bus at least once:

- weights, each read once per step however many rows use it: every layer's attention projections,
  dense MLP and router, the experts the step's tokens route to (the expected number under uniform
  routing), the embedding as the LM head (and again for the soft embedding), and the
  self-conditioning MLP;
- KV cache: K and V of the cached positions each row attends to, per layer (the last window - 1 on
  sliding layers), and those a prompt or commit row writes;
- logits: canvas tokens x vocabulary x 4 bytes of float32 written by the LM head and read back by
  the sampler, and read once more by the soft embedding of a canvas with a step left.

Elementwise work (norms, softmax, rotary) is left out: it is small in FLOPs, and its traffic depends
on how well a kernel keeps activations in cache. `measure_peak` times the matmul kernels the engine
uses on a large square product, and the copy bandwidth of a tensor far larger than the caches.
`bound` turns costs into the least time the steps can take, max(FLOPs / matmul peak, bytes / copy
bandwidth) per step, and names the resource that binds; measured time over it is the fraction of the
bound reached. Achieved GFLOP/s over the matmul peak alone (the fraction of peak) understates a
batch-1 step, which is bound by the bytes of its weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from blockdiff.config import ModelConfig
from blockdiff.model.gemma_config import GemmaConfig, LayerSpec
from blockdiff.model.attention import Row
from blockdiff.ops.matmul import linear


@dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else 0.0


def _token_weights(config: GemmaConfig, spec: LayerSpec) -> tuple[int, int]:
    """(dense weight elements every token multiplies, expert weight elements of one expert)."""
    h, heads, hd, kv = config.hidden_size, config.num_heads, spec.head_dim, spec.num_kv_heads
    attention = h * (heads * hd + kv * hd * (2 if spec.has_v_proj else 1)) + heads * hd * h
    dense = attention + 3 * h * config.intermediate_size + h * config.num_experts
    return dense, 3 * h * config.moe_intermediate_size


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the text model (the tied embedding once), from the config alone."""
    g = config.arch
    h = g.hidden_size
    total = config.vocab_size * h + h + h + 3 * h * g.intermediate_size  # embedding, final norm, self-conditioning
    for spec in g.layers:
        dense, expert = _token_weights(g, spec)
        total += dense + g.num_experts * expert  # projections, dense MLP, router, experts
        total += 2 * spec.head_dim + 7 * h + h + g.num_experts + 2  # q/k norms, block norms, router scales, layer scalars
    return total


def _keys_seen(start: int, length: int, decoder: bool, window: int | None) -> int:
    """Σ over the row's queries of the keys each one attends to."""
    if decoder:  # the cached prefix (the last window - 1 positions on sliding layers) + the canvas
        cached = start if window is None else min(start, window - 1)
        return length * (cached + length)
    # causal: query i sees positions <= start + i, the last `window` of them on sliding layers
    total = 0
    for i in range(length):
        seen = start + i + 1
        total += seen if window is None else min(seen, window)
    return total


def _expected_experts(tokens: int, config: GemmaConfig) -> float:
    """Experts a batch of `tokens` touches on average under uniform routing."""
    e, k = config.num_experts, config.top_k_experts
    return e * (1.0 - (1.0 - k / e) ** tokens)


def plan_cost(config: ModelConfig, rows: list[Row], steps: list[int], new_canvases: int, dtype_bytes: int,
              weight_bytes: float | None = None) -> Cost:
    """FLOPs and compulsory bytes of one engine step of DiffusionGemma (`config.arch` is its
    GemmaConfig) over `rows` (a plan's rows at their starts: encoder rows, then decoder rows, the
    canvases last), whose canvases are at steps n `steps`, `new_canvases` of them starting;
    `weight_bytes` per element of the layers' linear weights (1 for FP8 checkpoints; default
    `dtype_bytes`), the embedding and the KV cache in `dtype_bytes`."""
    g = config.arch
    h, v, b = g.hidden_size, config.vocab_size, dtype_bytes
    w = b if weight_bytes is None else weight_bytes
    tokens = sum(r.length for r in rows)
    dec_rows = [r for r in rows if r.decoder]
    dec_tokens = sum(r.length for r in dec_rows)
    cost = Cost()
    for spec in g.layers:
        dense, expert = _token_weights(g, spec)
        kv_width = spec.num_kv_heads * spec.head_dim
        cost.flops += 2 * tokens * (dense + g.top_k_experts * expert)
        cost.bytes += w * (dense + _expected_experts(tokens, g) * expert)
        window = spec.window if spec.sliding else None
        for r in rows:
            cost.flops += 4 * g.num_heads * spec.head_dim * _keys_seen(r.start, r.length, r.decoder, window)
            cached = r.start if window is None else min(r.start, window - 1)
            cost.bytes += 2 * b * kv_width * cached
            if not r.decoder:
                cost.bytes += 2 * b * kv_width * (r.length if window is None else min(r.length, window - 1))
    if dec_rows:
        # LM head, then the sampler reads the float32 logits once.
        cost.flops += 2 * dec_tokens * h * v
        cost.bytes += b * v * h + 2 * 4 * dec_tokens * v
        if new_canvases < len(dec_rows):
            # The self-conditioning MLP runs over every canvas of the step once any has a previous
            # step (a new canvas feeds zeros, whose MLP output is zero).
            cost.flops += 2 * dec_tokens * 3 * h * g.intermediate_size
            cost.bytes += w * 3 * h * g.intermediate_size
        # Canvases with steps left compute soft embeddings for the next one. Exact when no canvas
        # ends early, as in `bench offline` (its stability threshold is never reached).
        continuing = sum(r.length for r, n in zip(dec_rows[len(dec_rows) - len(steps):], steps) if n > 1)
        if continuing:  # probabilities @ embedding
            cost.flops += 2 * continuing * v * h
            cost.bytes += b * v * h + 4 * continuing * v
    return cost


def generate_costs(config: ModelConfig, batch: int, prompt: int, new: int, steps: int, dtype_bytes: int,
                   weight_bytes: float | None = None) -> list[Cost]:
    """`plan_cost` of each engine step of a generate of `batch` sequences of `prompt` tokens and
    `new` generated ones in canvases of `config.canvas_length`, each denoised `steps` times (none
    stopping early), the sequences in lockstep as `bench offline` runs them: one prefill step of
    every prompt, then per canvas its `steps` denoising steps and (all but the last canvas, which is
    never read back) one commit step."""
    canvas = config.canvas_length
    costs = [plan_cost(config, [Row(i, 0, prompt, False) for i in range(batch)], [], 0, dtype_bytes, weight_bytes)]
    for c in range(-(-new // canvas)):
        start = prompt + c * canvas
        for n in range(steps, 0, -1):
            costs.append(plan_cost(config, [Row(i, start, canvas, True) for i in range(batch)], [n] * batch,
                                   batch if n == steps else 0, dtype_bytes, weight_bytes))
        if start + canvas < prompt + new:
            costs.append(plan_cost(config, [Row(i, start, canvas, False) for i in range(batch)], [], 0, dtype_bytes,
                                   weight_bytes))
    return costs


def sequence_flops(config: ModelConfig, prompt: int, new: int, steps: int) -> float:
    """The useful FLOPs of one sequence of `prompt` tokens and `new` generated ones in canvases of
    `config.canvas_length`, each denoised `steps` times (none stopping early), by `plan_cost`:
    2 x active parameters x tokens (the prompt once, each canvas once per step, each committed
    canvas but the last once more), the LM head per canvas token and step, the self-conditioning
    product (the soft embedding of each step with a next one, and the self-conditioning MLP of each
    step after the first) and attention over the keys each query sees."""
    return sum(c.flops for c in generate_costs(config, 1, prompt, new, steps, 2))


@dataclass
class Bound:
    """The least time some engine steps can take: each step takes at least its compulsory bytes at
    the memory bandwidth or its FLOPs at the matmul rate, whichever is longer. At batch 1
    DiffusionGemma-26B-A4B's step is bound by its ~50 GB of weights; at batch 16 by its ~37 TFLOP."""

    seconds: float  # Σ over the steps of the longer of the two
    memory_s: float  # Σ bytes / bandwidth
    compute_s: float  # Σ FLOPs / matmul rate

    @property
    def limit(self) -> str:
        """The resource that binds the steps taken together: "bytes" or "FLOPs"."""
        return "bytes" if self.memory_s >= self.compute_s else "FLOPs"

    def fraction(self, seconds: float) -> float:
        """The fraction of the bound that steps measured to take `seconds` reach."""
        return self.seconds / seconds if seconds else 0.0


def bound(steps: Cost | Iterable[Cost], bandwidth_gbs: float, gflops: float) -> Bound:
    """The byte-aware bound of one step's cost, or of the costs of a run's steps (bandwidth and
    matmul rate as `measure_peak` measures them)."""
    costs = [steps] if isinstance(steps, Cost) else list(steps)
    memory = [c.bytes / (bandwidth_gbs * 1e9) for c in costs]
    compute = [c.flops / (gflops * 1e9) for c in costs]
    return Bound(sum(map(max, memory, compute)), sum(memory), sum(compute))


@dataclass
class Peak:
    gflops: float
    kernel: str
    bandwidth_gbs: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, min_time: float) -> float:
    fn()
    _sync(device)
    best, spent = float("inf"), 0.0
    while spent < min_time:
        t = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


def measure_peak(device: torch.device | str, dtype: torch.dtype, min_time: float = 0.3, size: int | None = None) -> Peak:
    """Best matmul GFLOP/s over the kernels the engine may use, on a square product big enough to
    be compute-bound (`size`, default 1024 on the CPU, 8192 on GPUs), and the copy bandwidth of a
    tensor far larger than the caches."""
    device = torch.device(device)
    n = size or (1024 if device.type == "cpu" else 8192)
    a = torch.randn(n, n, device=device).to(dtype)
    w = torch.randn(n, n, device=device).to(dtype)
    kernels = {"blockdiff linear": lambda: linear(a, w), "torch.mm": lambda: torch.mm(a, w)}
    rates = {name: 2 * n**3 / _best_seconds(fn, device, min_time) / 1e9 for name, fn in kernels.items()}
    kernel = max(rates, key=rates.get)
    big = torch.empty(64 * 2**20 // 4 * (4 if device.type == "cuda" else 1), device=device)
    out = torch.empty_like(big)
    seconds = _best_seconds(lambda: out.copy_(big), device, min_time)
    return Peak(rates[kernel], kernel, 2 * big.numel() * big.element_size() / seconds / 1e9)
