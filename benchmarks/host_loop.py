"""How much of a denoising step is the host's (issue 28), measured on the engine as it runs.

    OMP_NUM_THREADS=1 python benchmarks/host_loop.py share MODEL [--batches 1,8] [--num-scheduler-steps 1,4,8]
    OMP_NUM_THREADS=1 python benchmarks/host_loop.py long-output TINY_MODEL [--tokens 16384]
    OMP_NUM_THREADS=1 python benchmarks/host_loop.py tp-bytes TINY_MODEL [--contexts 1024,16384] [--num-scheduler-steps K] [--canvases N]

`share`: `LLM.generate` as `bench offline` runs it (128-token prompts, 256 new tokens, every canvas
taking 8 steps); of each engine step whose rows are all canvases, the wall time of `engine.step()`
and the time spent in the model's forward, the sampler's step and the soft-embedding product (the
device's work on a GPU) — the rest is the host's: scheduling, planning, copies, metadata, output
processing. Per denoising step of the batch, with several steps per launch divided among them.

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


def _watch_plans(engine) -> list:
    """The plans the executor runs, appended as they go (the executor's execute, wrapped)."""
    plans, execute = [], engine.executor.execute

    def watched(plan):
        plans.append(plan)
        return execute(plan)

    engine.executor.execute = watched
    return plans


def _instrumented(llm: LLM) -> tuple[Clock, list]:
    runner = _runner(llm)
    compute = Clock()
    compute.wrap(runner.model, "forward")
    compute.wrap(runner.sampler, "step")
    compute.wrap(runner.vocab, "soft_embed")
    return compute, _watch_plans(llm.engine)


def _one_run(llm: LLM, compute: Clock, plans: list, prompts, params) -> tuple[float, float, int]:
    """-> (wall seconds, compute seconds, denoising steps) of the engine steps whose rows are all canvases."""
    engine = llm.engine
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    wall = busy = 0.0
    steps = 0
    while engine.has_unfinished():
        before, n = compute.seconds, len(plans)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        ran = plans[n:]
        if ran and all(r.decoder for r in ran[0].rows):
            wall += dt
            busy += compute.seconds - before
            steps += getattr(ran[0], "steps", 1)
    return wall, busy, steps


def share(args) -> None:
    """Each K's engine in one process, their runs alternating, so that they share the machine's load."""
    print(f"blockdiff from {blockdiff.__file__}")
    batches = [int(b) for b in args.batches.split(",")]
    ks = [None] if args.num_scheduler_steps is None else [int(k) for k in args.num_scheduler_steps.split(",")]
    llms = {k: LLM(args.model, max_num_seqs=max(batches), max_model_len=128 + 256,
                   **({} if k is None else {"num_scheduler_steps": k})) for k in ks}
    tools = {k: _instrumented(llm) for k, llm in llms.items()}
    print(f"{'batch':>5} {'K':>3} {'ms/step':>9} {'compute':>9} {'host':>8} {'host share':>10} {'s/run':>7}")
    for batch in batches:
        params = [SamplingParams(max_tokens=256, max_denoising_steps=8, stability_threshold=8, ignore_eos=True,
                                 seed=i) for i in range(batch)]
        prompts = [[(7 * i + 13 * j) % 8000 + 100 for j in range(128)] for i in range(batch)]
        runs = {k: [] for k in ks}
        for rep in range(args.reps + 1):
            for k in ks:
                t = time.perf_counter()
                wall, busy, steps = _one_run(llms[k], *tools[k], prompts, params)
                if rep:  # the first run warms up
                    runs[k].append((wall / steps, busy / steps, time.perf_counter() - t))
        for k in ks:
            wall, busy, total = (statistics.median(r[i] for r in runs[k]) for i in (0, 1, 2))
            shown = getattr(_runner(llms[k]), "steps_per_launch", 1)
            print(f"{batch:>5} {shown:>3} {wall * 1e3:>9.2f} {busy * 1e3:>9.2f} {(wall - busy) * 1e3:>8.2f} "
                  f"{(wall - busy) / wall:>10.1%} {total:>7.3f}")
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
            steady = [p for p in plans[n:] if p.denoise is not None and not p.new_canvas_rows
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
