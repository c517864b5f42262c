"""How much of a denoising step is the host's, measured on the engine as it runs.

    OMP_NUM_THREADS=1 python benchmarks/host_loop.py share MODEL [--batches 1,8] [--num-scheduler-steps 1,4,8] [--async-scheduling off,on]
    OMP_NUM_THREADS=1 python benchmarks/host_loop.py long-output TINY_MODEL [--tokens 16384]
    OMP_NUM_THREADS=1 python benchmarks/host_loop.py tp-bytes TINY_MODEL [--contexts 1024,16384] [--num-scheduler-steps K] [--canvases N]

`share`: `LLM.generate` as `bench offline` runs it (128-token prompts, 256 new tokens, every canvas
taking 8 steps); of each engine step whose rows are all canvases, its wall time as the device sees
it (from the end of the step before to its own end) and the time spent in the model's forward, the
sampler's step and the soft-embedding product (the device's work on a GPU) — the rest is the
host's: scheduling, planning, copies, metadata, output processing, less what async scheduling
overlaps with the step. Per denoising step of the batch, with several steps per launch divided
among them.

`long-output`: one request of `--tokens` new tokens at one denoising step per canvas; the cost of a
committed canvas (its step and its commit) near 1,024 output tokens and near the end, and the time
inside attention beside it.

`tp-bytes`: the message rank 0 sends to the tensor-parallel workers for a steady-state step (every
canvas going on, none starting) of `--canvases` requests (each with its own seed and temperature)
at each context length; of the steps with the most canvases at once (long prompts prefill in turns).

Runs on this tree or, with PYTHONPATH pointing at another checkout, on that one (what "before" is
in docs/benchmarks.md): it uses only what both have.
"""

from __future__ import annotations

import argparse
import statistics
import time

import blockdiff
from blockdiff import LLM, SamplingParams


class Clock:
    """Seconds spent inside the wrapped callables."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        setattr(obj, name, timed)


def _runner(llm: LLM):
    return llm.engine.executor.runner


class Execution:
    """One plan the executor ran: when it started and ended, and the compute time inside it."""

    def __init__(self, plan, start: float, end: float, compute: float):
        self.plan, self.start, self.end, self.compute = plan, start, end, compute


def _watch_plans(engine, compute: Clock | None = None) -> list[Execution]:
    """The plans the executor runs, appended as they end (the executor's execute, wrapped; it runs
    on the engine's step thread where the engine has one)."""
    runs, execute = [], engine.executor.execute

    def watched(plan):
        before, t = compute.seconds if compute else 0.0, time.perf_counter()
        try:
            return execute(plan)
        finally:
            runs.append(Execution(plan, t, time.perf_counter(), (compute.seconds if compute else 0.0) - before))

    engine.executor.execute = watched
    return runs


def _instrumented(llm: LLM) -> tuple[Clock, list[Execution]]:
    runner = _runner(llm)
    compute = Clock()
    compute.wrap(runner.model, "forward")
    compute.wrap(runner.sampler, "step")
    compute.wrap(runner.vocab, "soft_embed")
    return compute, _watch_plans(llm.engine, compute)


def _one_run(llm: LLM, runs: list[Execution], prompts, params) -> tuple[float, float, float, int]:
    """-> (wall seconds, compute seconds, idle seconds, denoising steps) of the engine steps whose
    rows are all canvases. A step's wall time is what the device sees: from the end of the step
    before it to its own end, so the host's work between two steps counts, overlapped with the step
    or not; idle is the part of it before the step started (no plan in the executor's hands)."""
    engine = llm.engine
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    first = len(runs)
    while engine.has_unfinished():
        engine.step()
    wall = busy = idle = 0.0
    steps = 0
    ran = runs[first:]
    for before, run in zip(ran, ran[1:]):
        if all(r.decoder for r in run.plan.rows):
            wall += run.end - before.end
            busy += run.compute
            idle += run.start - before.end
            steps += getattr(run.plan, "steps", 1)
    return wall, busy, idle, steps


def _options(values: str | None, parse) -> list:
    return [None] if values is None else [parse(v) for v in values.split(",")]


def share(args) -> None:
    """Each configuration's engine in one process, their runs alternating, so that they share the
    machine's load."""
    print(f"blockdiff from {blockdiff.__file__}")
    batches = [int(b) for b in args.batches.split(",")]
    configs = [(k, a) for k in _options(args.num_scheduler_steps, int)
               for a in _options(args.async_scheduling, lambda v: {"on": True, "off": False}[v])]
    llms = {c: LLM(args.model, max_num_seqs=max(batches), max_model_len=128 + 256,
                   **({} if c[0] is None else {"num_scheduler_steps": c[0]}),
                   **({} if c[1] is None else {"async_scheduling": c[1]})) for c in configs}
    tools = {c: _instrumented(llm) for c, llm in llms.items()}
    print(f"{'batch':>5} {'K':>3} {'async':>5} {'ms/step':>9} {'compute':>9} {'host':>8} {'host share':>10} "
          f"{'idle':>7} {'s/run':>7}")
    for batch in batches:
        params = [SamplingParams(max_tokens=256, max_denoising_steps=8, stability_threshold=8, ignore_eos=True,
                                 seed=i) for i in range(batch)]
        prompts = [[(7 * i + 13 * j) % 8000 + 100 for j in range(128)] for i in range(batch)]
        runs = {c: [] for c in configs}
        for rep in range(args.reps + 1):
            for c in configs:
                t = time.perf_counter()
                wall, busy, idle, steps = _one_run(llms[c], tools[c][1], prompts, params)
                if rep:  # the first run warms up
                    runs[c].append((wall / steps, busy / steps, idle / steps, time.perf_counter() - t))
        for c in configs:
            wall, busy, idle, total = (statistics.median(r[i] for r in runs[c]) for i in range(4))
            shown = getattr(_runner(llms[c]), "steps_per_launch", 1)
            overlap = getattr(llms[c].engine, "async_scheduling", None)
            overlap = "-" if overlap is None else ("on" if overlap else "off")
            print(f"{batch:>5} {shown:>3} {overlap:>5} {wall * 1e3:>9.2f} {busy * 1e3:>9.2f} {(wall - busy) * 1e3:>8.2f} "
                  f"{(wall - busy) / wall:>10.1%} {idle * 1e3:>7.2f} {total:>7.3f}")
    for llm in llms.values():
        llm.shutdown()


def long_output(args) -> None:
    print(f"blockdiff from {blockdiff.__file__}")
    with LLM(args.model, max_model_len=args.tokens + 64) as llm:
        engine, runner = llm.engine, _runner(llm)
        cl = engine.canvas_length
        attention = Clock()
        for layer in runner.model.modules():
            if type(layer).__name__ == "Attention":
                attention.wrap(layer, "forward")
        req = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=args.tokens, max_denoising_steps=1,
                                                              ignore_eos=True, seed=0))
        marks = []  # (output tokens, time, attention seconds) at each commit
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            n = len(req.output.token_ids)
            if not marks or n != marks[-1][0]:
                marks.append((n, time.perf_counter() - t0, attention.seconds))
    window = max(1, 256 // cl)  # canvases per measurement

    def per_canvas(end_tokens: int) -> tuple[float, float]:
        i = next(i for i, m in enumerate(marks) if m[0] >= end_tokens)
        a, b = marks[max(0, i - window)], marks[i]
        canvases = (b[0] - a[0]) / cl
        return (b[1] - a[1]) / canvases, (b[2] - a[2]) / canvases

    short, long = per_canvas(1024), per_canvas(args.tokens)
    print(f"canvas {cl}, one denoising step per canvas, {window} canvases per figure")
    print(f"{'output tokens':>14} {'ms/canvas':>10} {'attention ms':>13}")
    for tokens, (total, attn) in ((1024, short), (args.tokens, long)):
        print(f"{tokens:>14,} {total * 1e3:>10.2f} {attn * 1e3:>13.2f}")
    print(f"ratio {args.tokens:,}/1,024: {long[0] / short[0]:.2f}x per canvas, {long[1] / short[1]:.2f}x attention")


def tp_bytes(args) -> None:
    from blockdiff.executor.tensor_parallel import _execute
    from blockdiff.parallel.ranks import _dumps

    print(f"blockdiff from {blockdiff.__file__}")
    contexts = [int(c) for c in args.contexts.split(",")]
    kw = {} if args.num_scheduler_steps is None else {"num_scheduler_steps": args.num_scheduler_steps}
    with LLM(args.model, max_model_len=max(contexts) + 128, **kw) as llm:
        engine = llm.engine
        plans = _watch_plans(engine)
        print(f"{'context':>8} {'canvases':>8} {'bytes/message':>13} {'steps/message':>13} {'bytes/step':>10}")
        for context in contexts:
            n = len(plans)
            # one request per canvas, each with its own seed and temperature
            llm.generate([[5 + (i + c) % 250 for i in range(context)] for c in range(args.canvases)],
                         [SamplingParams(max_tokens=2 * engine.canvas_length, max_denoising_steps=16, ignore_eos=True,
                                         seed=c, temperature=1.0 - 0.05 * c) for c in range(args.canvases)],
                         use_tqdm=False)
            steady = [p for p in (run.plan for run in plans[n:]) if p.denoise is not None and not p.new_canvas_rows
                      and all(r.decoder for r in p.rows)]
            most = max(len(p.rows) for p in steady)  # long prompts prefill in turns: the most canvases at once
            size, steps = max((len(_dumps((_execute, (p,), False))), getattr(p, "steps", 1)) for p in steady
                              if len(p.rows) == most)
            print(f"{context:>8,} {most:>8} {size:>13,} {steps:>13} {size / steps:>10,.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("share")
    s.add_argument("model")
    s.add_argument("--batches", default="1,8")
    s.add_argument("--reps", type=int, default=3)
    s.add_argument("--num-scheduler-steps", default=None, help="comma-separated values of K, run alternating")
    s.add_argument("--async-scheduling", default=None, help="on, off or both (on,off), run alternating")
    s = sub.add_parser("long-output")
    s.add_argument("model")
    s.add_argument("--tokens", type=int, default=16384)
    s = sub.add_parser("tp-bytes")
    s.add_argument("model")
    s.add_argument("--contexts", default="1024,16384")
    s.add_argument("--num-scheduler-steps", type=int, default=None)
    s.add_argument("--canvases", type=int, default=1, help="requests denoised together")
    args = p.parse_args()
    {"share": share, "long-output": long_output, "tp-bytes": tp_bytes}[args.what](args)


if __name__ == "__main__":
    main()
