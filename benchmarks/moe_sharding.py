"""How to split DiffusionGemma's experts over N ranks: by expert width or by expert (expert parallelism).

For one MoE block at DiffusionGemma-26B-like shapes, this measures on this machine the expert
compute of one rank under each scheme, with the same kernel for both: `--kernel padded` is
`model.moe.Experts` (tokens sorted into per-expert groups, each padded to a multiple of 8 rows, one
product per expert), `--kernel grouped` one unpadded product per expert with tokens (what a grouped
GEMM does):

- intermediate split (IS): every rank runs all E experts at width I/N on all tokens; the ranks'
  work is equal by construction.
- expert parallelism (EP): rank r runs experts [rE/N, (r+1)E/N) at full width on the
  (token, expert) pairs routed to them; the step waits for the busiest rank.

Under tensor parallelism every rank already holds every token's hidden state, so both schemes end
the block with the same one all-reduce of [tokens, hidden] partial sums (EP needs an all-to-all only
when tokens are split over ranks, i.e. with data parallelism): the choice is about compute and balance.

Routing is drawn from a router with a random per-expert bias (real routers are uneven; `--skew 0`
is uniform). Printed: the fastest of the interleaved repetitions (ms) of one IS rank and of the
busiest and the idlest EP rank.

    python benchmarks/moe_sharding.py [--tokens 256] [--ranks 2,4] [--skew 0,1] [--reps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from blockdiff.model.gemma_config import GemmaConfig
from blockdiff.model.registry import parse_config
from blockdiff.ops.matmul import linear
from blockdiff.model.moe import Experts
from blockdiff.model.tiny import TinySpec, config_dict
from blockdiff.parallel.group import TPGroup


def experts(config: GemmaConfig, num_experts: int, width: int, ranks: int) -> Experts:
    """One rank's experts: `num_experts` of them, `width` wide once split over `ranks`."""
    config = dataclasses.replace(config, num_experts=num_experts, moe_intermediate_size=width)
    module = Experts(config, TPGroup(rank=0, size=1), torch.float32)
    module.local = width // ranks  # one rank's share of every expert, as a group of `ranks` builds it
    g = torch.Generator().manual_seed(0)
    module.gate_up.data = torch.randn(num_experts, 2 * module.local, config.hidden_size, generator=g) * config.hidden_size**-0.5
    module.down.data = torch.randn(num_experts, config.hidden_size, module.local, generator=g) * module.local**-0.5
    return module


def grouped(module: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The same experts without padding: one product per expert over exactly its tokens."""
    out = torch.zeros_like(x)
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=module.num_experts).tolist()
    token, w = order // index.shape[1], weights.reshape(-1)[order, None]
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = token[start : start + n]
            gate, up = linear(x[rows], module.gate_up[e]).split(module.local, dim=-1)
            out.index_add_(0, rows, linear(module.act(gate) * up, module.down[e]) * w[start : start + n])
        start += n
    return out


def route(tokens: int, num_experts: int, k: int, skew: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g) + skew * torch.randn(num_experts, generator=g)
    weights, index = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), index


def best_ms(fns: dict, reps: int) -> dict[str, float]:
    """Fastest of `reps` interleaved runs of each: on a shared machine other processes only add time."""
    times = {name: [] for name in fns}
    for i in range(reps):
        for name in list(fns)[:: 1 if i % 2 == 0 else -1]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) * 1e3 for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens in the step (one canvas: 256)")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--skew", default="0,1", help="spread of the router's per-expert bias")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--width", type=int, default=704, help="moe_intermediate_size")
    p.add_argument("--kernel", default="padded", choices=["padded", "grouped"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = TinySpec(hidden_size=args.hidden, num_experts=args.experts, top_k_experts=args.top_k, moe_intermediate_size=args.width)
    config = parse_config(config_dict(spec))
    e, k, h, t = args.experts, args.top_k, args.hidden, args.tokens
    x = torch.randn(t, h)
    kernel = (lambda m, *a: m(*a)) if args.kernel == "padded" else grouped
    print(f"MoE block: {t} tokens, hidden {h}, {e} experts top-{k}, width {args.width}, float32, {args.kernel} kernel, "
          f"{torch.get_num_threads()} threads, best of {args.reps} interleaved repetitions")
    for n in map(int, args.ranks.split(",")):
        split, whole = experts(config, e, args.width, n), experts(config, e // n, args.width, 1)
        for skew in map(float, args.skew.split(",")):
            weights, index = route(t, e, k, skew)
            fns = {"IS": lambda: kernel(split, x, weights, index)}
            loads = []
            for r in range(n):
                mine = (index // (e // n)) == r
                token, slot = mine.nonzero(as_tuple=True)
                pairs, local = x[token], (index[token, slot] % (e // n)).unsqueeze(-1)
                pair_weights = weights[token, slot].unsqueeze(-1)
                fns[f"EP{r}"] = lambda pairs=pairs, w=pair_weights, i=local: kernel(whole, pairs, w, i)
                loads.append(len(token))
            ms = best_ms(fns, args.reps)
            ep = [ms[f"EP{r}"] for r in range(n)]
            print(f"  N={n} skew {skew:g}: IS rank {ms['IS']:7.1f} ms | EP busiest {max(ep):7.1f} ms, idlest {min(ep):7.1f} ms "
                  f"(pairs per rank {min(loads)}..{max(loads)}) | EP busiest / IS {max(ep) / ms['IS']:.2f}")


if __name__ == "__main__":
    main()
