"""`blockdiff bench offline`: latency and throughput of `LLM.generate` with a fixed number of
denoising steps per canvas, optionally side by side with transformers' generate on the same
checkpoint and settings, and a roofline of the denoising steps and commits."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch
from tqdm import tqdm

from blockdiff.bench.datasets import random_token_prompts, special_token_ids
from blockdiff.config import parse_dtype
from blockdiff.bench.roofline import Cost, Peak, bound, measure_peak, parameter_count, plan_cost, sequence_flops
from blockdiff.engine.request import State
from blockdiff.model.attention import Row
from blockdiff.arg_utils import add_engine_args, at_least, engine_config
from blockdiff.sampling_params import DENOISING_MODES, SamplingParams

WIDTH = 96  # the report's, that of its widest table (the roofline)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes; the first row is the latency row")
    p.add_argument("--input-len", type=at_least(1), default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=at_least(1), default=256, help="new tokens per request")
    p.add_argument("--denoising-steps", type=at_least(1), default=8, help="denoising steps every canvas takes "
                   "(at most, in the fast mode)")
    p.add_argument("--denoising-mode", choices=DENOISING_MODES, default="exact",
                   help="exact: the reference's steps; fast: positions settle early (docs/architecture.md)")
    p.add_argument("--num-iters", type=at_least(1), default=3, help="timed runs per batch size and engine (the median is shown)")
    p.add_argument("--num-warmup", type=at_least(0), default=1, help="untimed runs per batch size and engine")
    p.add_argument("--compare", choices=["transformers"], default=None,
                   help="also run transformers' generate, alternating with blockdiff, and show the speedup")
    p.add_argument("--output-json", default=None, help="write every figure to this JSON file")


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


@dataclasses.dataclass
class PhaseTiming:
    """Measured engine steps of one kind (denoise / commit / prefill) and the work each did."""

    seconds: float = 0.0
    costs: list[Cost] = dataclasses.field(default_factory=list)  # one per step

    def add(self, seconds: float, cost: Cost, steps: int = 1) -> None:
        """One launch of `steps` steps that each cost `cost`."""
        self.seconds += seconds
        self.costs += [cost] * steps

    @property
    def steps(self) -> int:
        return len(self.costs)

    @property
    def cost(self) -> Cost:
        return sum(self.costs, Cost())

    def as_dict(self, peak: Peak) -> dict:
        steps, cost = max(1, self.steps), self.cost
        gflops = cost.flops / self.seconds / 1e9 if self.seconds else 0.0
        limit = bound(self.costs, peak.bandwidth_gbs, peak.gflops)
        return {
            "steps": self.steps,
            "ms_per_step": self.seconds / steps * 1e3,
            "gflop_per_step": cost.flops / steps / 1e9,
            "mb_per_step": cost.bytes / steps / 1e6,
            "flop_per_byte": cost.intensity,
            "gflops": gflops,
            "fraction_of_peak": gflops / peak.gflops if peak.gflops else 0.0,
            "bound_ms_per_step": limit.seconds / steps * 1e3,
            "bound_by": limit.limit,
            "fraction_of_bound": limit.fraction(self.seconds),
        }


def _step_kind(plan, states_by_slot: dict) -> str:
    kinds = set()
    for r in plan.rows:
        if r.decoder:
            kinds.add("denoise")
        else:
            kinds.add("commit" if states_by_slot.get(r.slot) == State.COMMIT else "prefill")
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _plan_cost(engine, plan, dtype_bytes: int) -> Cost:
    """The roofline cost of a plan the engine just ran: its rows start at their requests' cached
    lengths and its canvases are at their steps n (the requests are as they were planned until the
    engine reads the step's output)."""
    by_slot = {r.slot: r for r in engine.scheduler.running}
    rows = [Row(r.slot, by_slot[r.slot].num_cached, r.length, r.decoder) for r in plan.rows]
    canvases = [r for r in plan.rows if r.decoder][0 if plan.score is None else len(plan.score.lengths):]
    return plan_cost(engine.model_config, rows, [by_slot[r.slot].steps_left for r in canvases], len(plan.new_canvas_rows),
                     dtype_bytes)


def profile_steps(llm, prompts: list[list[int]], params: list[SamplingParams], dtype: torch.dtype) -> dict[str, PhaseTiming]:
    """One generation driven step by step through the engine (as LLM.generate drives it), each step
    timed and costed by kind: "denoise" (only canvases being denoised), "commit" (only finished
    canvases), "prefill" (only prompt tokens), or "mixed"."""
    engine = llm.engine
    dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    phases: dict[str, PhaseTiming] = {}
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]

    executor = engine.executor
    execute = executor.execute

    def timed(plan):
        """The executor's execute, timed and costed (the engine has no hooks: the benchmark wraps it).
        It runs on the engine's step thread, while the requests' states are those the plan was made from."""
        kind = _step_kind(plan, {r.slot: r.state for r in engine.scheduler.running})
        t0 = time.perf_counter()
        out = execute(plan)
        phases.setdefault(kind, PhaseTiming()).add(time.perf_counter() - t0, _plan_cost(engine, plan, dtype_bytes), plan.steps)
        return out

    executor.execute = timed
    try:
        while engine.has_unfinished():
            engine.step()
    finally:  # finished requests are gone already; this drops any left by an error
        del executor.execute  # the class's method again
        for rid in ids:
            engine.abort(rid)
    return phases


def median_phases(runs: list[dict[str, PhaseTiming]]) -> dict[str, PhaseTiming]:
    """Per phase, the profiled run of median speed (FLOPs per second)."""
    out = {}
    for kind in {k for r in runs for k in r}:
        timings = sorted((r[kind] for r in runs if kind in r), key=lambda p: p.cost.flops / max(p.seconds, 1e-12))
        out[kind] = timings[len(timings) // 2]
    return out


def run(args: argparse.Namespace) -> int:
    from blockdiff.llm import LLM

    batch_sizes = parse_batch_sizes(args.batch_sizes)
    cfg = engine_config(args)
    cfg = dataclasses.replace(
        cfg,
        max_num_seqs=max(cfg.max_num_seqs, max(batch_sizes)),
        max_model_len=cfg.max_model_len or args.input_len + args.output_len,
    )
    llm = LLM(**dataclasses.asdict(cfg))
    try:
        return _benchmark(llm, cfg, args, batch_sizes)
    finally:
        llm.shutdown()


def _benchmark(llm, cfg, args: argparse.Namespace, batch_sizes: list[int]) -> int:
    engine = llm.engine
    device = cfg.resolved_device()
    config = engine.model_config
    dtype = parse_dtype(cfg.dtype, config, device)
    reference = None
    if args.compare == "transformers":
        from blockdiff.bench.reference import TransformersRunner

        reference = TransformersRunner(cfg.model, dtype, device, args.output_len, args.denoising_steps)

    peak = measure_peak(device, dtype)
    steps = args.denoising_steps
    header = {
        "model": cfg.model,
        "parameters": parameter_count(config),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "threads": torch.get_num_threads(),
        "steps_per_launch": engine.executor.steps_per_launch,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "denoising_steps": steps,
        "num_iters": args.num_iters,
        "num_warmup": args.num_warmup,
        "peak_gflops": peak.gflops,
        "peak_kernel": peak.kernel,
        "bandwidth_gbs": peak.bandwidth_gbs,
        "compare": args.compare,
        "transformers": reference.version if reference else None,
    }
    _print_header(header)

    rows = []
    specials = special_token_ids(config)
    for batch in batch_sizes:
        prompts = random_token_prompts([args.input_len] * batch, config.vocab_size, specials, seed=args.seed + batch)
        # stability_threshold = steps: a canvas never counts as stable, so each takes every step.
        params = [
            SamplingParams(max_tokens=args.output_len, max_denoising_steps=steps, stability_threshold=steps,
                           ignore_eos=True, seed=args.seed + i, denoising_mode=args.denoising_mode)
            for i in range(batch)
        ]

        def ours() -> float:
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t
            done = [len(o.token_ids) for o in outs]
            if done != [args.output_len] * batch:
                raise RuntimeError(f"blockdiff generated {done} tokens, {args.output_len} each were asked")
            return seconds

        def theirs() -> float:
            return reference.generate(prompts, seed=args.seed)

        sides = [ours] + ([theirs] if reference else [])
        runs = (args.num_warmup + args.num_iters) * len(sides) + args.num_iters
        with tqdm(total=runs, desc=f"batch {batch}", unit="run", leave=False) as bar:
            for _ in range(args.num_warmup):
                for side in sides:
                    side()
                    bar.update()
            times: list[list[float]] = [[] for _ in sides]
            for _ in range(args.num_iters):  # alternate, so load on the machine hits both sides alike
                for i, side in enumerate(sides):
                    times[i].append(side())
                    bar.update()
            profiles = []
            for _ in range(args.num_iters):
                profiles.append(profile_steps(llm, prompts, params, dtype))
                bar.update()
        phases = median_phases(profiles)
        row = {"batch": batch, "blockdiff_s": statistics.median(times[0]), "blockdiff_runs_s": times[0]}
        row["blockdiff_tok_s"] = batch * args.output_len / row["blockdiff_s"]
        # The useful FLOPs of the batch (roofline.sequence_flops) over the time, as a fraction of the peak.
        useful = batch * sequence_flops(config, args.input_len, args.output_len, steps)
        row["blockdiff_of_peak"] = useful / row["blockdiff_s"] / 1e9 / peak.gflops
        if reference:
            row["transformers_s"] = statistics.median(times[1])
            row["transformers_runs_s"] = times[1]
            row["transformers_tok_s"] = batch * args.output_len / row["transformers_s"]
            row["speedup"] = row["transformers_s"] / row["blockdiff_s"]
            row["transformers_of_peak"] = useful / row["transformers_s"] / 1e9 / peak.gflops
        row["phases"] = {k: v.as_dict(peak) for k, v in sorted(phases.items())}
        rows.append(row)
        _print_row(row, reference is not None, first=batch == batch_sizes[0])

    _print_roofline(rows)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": header, "results": rows}, f, indent=2)
    return 0


def _print_header(h: dict) -> None:
    print("{s:{c}^{n}}".format(s=" Offline Benchmark ", n=WIDTH, c="="))
    tp = f", tensor parallel {h['tensor_parallel_size']}" if h["tensor_parallel_size"] > 1 else ""
    print(f"model: {h['model']} ({h['parameters'] / 1e6:.1f}M parameters, {h['dtype']}, {h['device']}{tp}, "
          f"{h['threads']} threads, torch {h['torch']})")
    print(f"requests: {h['input_len']} prompt tokens, {h['output_len']} new tokens, "
          f"{h['denoising_steps']} denoising steps per canvas, EOS ignored")
    print(f"timing: median of {h['num_iters']} runs after {h['num_warmup']} warmup"
          + (f", alternating with transformers {h['transformers']}" if h["compare"] else ""))
    print(f"measured peak: {h['peak_gflops']:.1f} GFLOP/s matmul ({h['peak_kernel']}), "
          f"{h['bandwidth_gbs']:.1f} GB/s copy")
    print("-" * WIDTH)


def _print_row(row: dict, compare: bool, first: bool) -> None:
    if first:
        cols = f"{'batch':>5} {'blockdiff s':>12} {'tok/s':>9} {'of peak':>8}"
        if compare:
            cols += f" {'transformers s':>15} {'tok/s':>9} {'of peak':>8} {'speedup':>8}"
        print(cols)
    line = f"{row['batch']:>5} {row['blockdiff_s']:>12.3f} {row['blockdiff_tok_s']:>9.1f} {row['blockdiff_of_peak']:>7.1%}"
    if compare:
        line += (f" {row['transformers_s']:>15.3f} {row['transformers_tok_s']:>9.1f} {row['transformers_of_peak']:>7.1%}"
                 f" {row['speedup']:>7.2f}x")
    print(line, flush=True)


def _print_roofline(rows: list[dict]) -> None:
    print("{s:{c}^{n}}".format(s=" Roofline (median of the profiled runs) ", n=WIDTH, c="-"))
    print(f"{'batch':>5} {'phase':>8} {'steps':>6} {'ms/step':>9} {'GFLOP/step':>11} {'MB/step':>9} "
          f"{'FLOP/B':>7} {'GFLOP/s':>8} {'of peak':>8} {'bound ms':>9} {'by':>5} {'of bound':>8}")
    for row in rows:
        for phase, p in row["phases"].items():
            print(f"{row['batch']:>5} {phase:>8} {p['steps']:>6} {p['ms_per_step']:>9.2f} {p['gflop_per_step']:>11.3f} "
                  f"{p['mb_per_step']:>9.1f} {p['flop_per_byte']:>7.1f} {p['gflops']:>8.1f} {p['fraction_of_peak']:>7.1%} "
                  f"{p['bound_ms_per_step']:>9.3f} {p['bound_by']:>5} {p['fraction_of_bound']:>7.1%}")
    print("bound: Σ over the steps of max(FLOPs / matmul peak, bytes of weights, KV and logits / copy bandwidth)")
    print("=" * WIDTH)
