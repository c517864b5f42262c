"""The fast denoising mode's speed against its accuracy, beside the exact mode, on the demo's
held-out eval (the problems `blockdiff eval --task demo` asks), greedy (or --sampled: at the
checkpoint's temperatures, seeded per problem), in one run.

    .venv/bin/python benchmarks/fast_mode.py [--model DIR] [--num 60] [--speed-problems 16] [--ttft-problems 8] [--rounds 3] [--sampled]

Settings (rows of the table): the exact mode at the seed's settings (confidence_threshold 0,
16 steps: every canvas runs every step), at the checkpoint's defaults (its adaptive stop), and
with fewer steps (4, no early stop: the naive way to go faster); the fast mode at its defaults
(over the checkpoint's defaults) and at other settings. Columns: accuracy per task and overall;
steps per canvas; denoising steps and rows evaluated (usage's canvas_positions_evaluated) per
committed token; committed tokens per second of wall time with the problems run one at a time
(batch 1) and eight at a time (batch 8); and the median time from a streamed chat's start to its
first text (in process, LLM.stream: what the server's first SSE chunk with text waits for). Every
setting runs on one engine; the timings go round-robin over the settings, `--rounds` times, and
the median of each is shown, so the ratios are side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from blockdiff import LLM, SamplingParams
from blockdiff.demo.evaluate import evaluate
from blockdiff.demo.tasks import EVAL_SEED, TASKS, heldout_problems

SETTINGS = {
    "exact, seed's settings (16 steps, no stop)": dict(confidence_threshold=0.0, max_denoising_steps=16),
    "exact, checkpoint defaults": {},
    # On the CPU the engine runs up to 4 exact steps per launch (--num-scheduler-steps), and a canvas
    # that stops early is still computed, masked, to the launch's end; the fast mode runs one per launch.
    "exact, checkpoint defaults, 1 step per launch": dict(launch=1),
    "exact, 4 steps (no stop)": dict(confidence_threshold=0.0, max_denoising_steps=4),
    "fast, defaults": dict(denoising_mode="fast"),
    "fast, settle_steps 2": dict(denoising_mode="fast", settle_steps=2),
    "fast, settle_entropy 0.05": dict(denoising_mode="fast", settle_entropy=0.05),
    "fast, no adaptive stop (16 steps)": dict(denoising_mode="fast", confidence_threshold=0.0, max_denoising_steps=16),
}


def _prompt(llm: LLM, problem) -> list[int]:
    kwargs = problem.template_kwargs()
    text = llm.tokenizer.apply_chat_template(problem.messages(), add_generation_prompt=True,
                                             tools=kwargs.pop("tools", None), **kwargs)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> float:
    """Committed tokens per second, the prompts run `batch` at a time."""
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i : i + batch], [replace(params, seed=i + j) for j in range(batch)][: len(prompts[i : i + batch])],
                            use_tqdm=False)
        tokens += sum(len(o.token_ids) for o in outs)
    return tokens / (time.perf_counter() - t0)


def _first_text(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Median seconds from a streamed request's start to its first output with text."""
    times = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        stream = llm.stream(prompt, replace(params, seed=i))
        for out in stream:
            if out.outputs[0].text:
                times.append(time.perf_counter() - t0)
                break
        stream.close()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo)")
    p.add_argument("--num", type=int, default=60, help="held-out problems for accuracy and the per-token figures")
    p.add_argument("--speed-problems", type=int, default=16, help="problems timed at batch 1 and 8")
    p.add_argument("--ttft-problems", type=int, default=8, help="streamed chats timed to their first text")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds over every setting (the median is shown)")
    p.add_argument("--sampled", action="store_true", help="sample at the checkpoint's temperatures instead of greedily")
    args = p.parse_args()
    problems = heldout_problems(args.num, EVAL_SEED, TASKS)
    engines = {0: LLM(args.model, max_num_seqs=128, max_model_len=384),
               1: LLM(args.model, max_num_seqs=128, max_model_len=384, num_scheduler_steps=1)}
    llm = engines[0]
    prompts = [_prompt(llm, pr) for pr in problems]
    base = SamplingParams(temperature=None if args.sampled else 0.0, skip_special_tokens=True)
    for engine in engines.values():
        _throughput(engine, prompts[:8], base, 8)  # warm-up
    figures = {}
    for name, values in SETTINGS.items():
        values = dict(values)
        llm = engines[values.pop("launch", 0)]
        params = replace(base, **values)
        result = evaluate(llm, problems, params)
        outs = llm.generate(prompts, [replace(params, seed=i) for i in range(len(prompts))], use_tqdm=False)
        figures[name] = (llm, params, result, result.denoising_steps / max(1, sum(o.metrics["canvases"] for o in outs)))
    # Timings round-robin over the settings, the median of the rounds: a load that drifts during
    # the run weighs on every setting alike.
    timed = {name: ([], [], []) for name in SETTINGS}
    for _ in range(args.rounds):
        for name, (llm, params, _, _) in figures.items():
            b1, b8, first = timed[name]
            b1.append(_throughput(llm, prompts[: args.speed_problems], params, 1))
            b8.append(_throughput(llm, prompts[: args.speed_problems], params, 8))
            first.append(_first_text(llm, prompts[: args.ttft_problems], replace(params, max_tokens=128)))
    for engine in engines.values():
        engine.shutdown()
    rows = [(name, result, per_canvas, {1: statistics.median(timed[name][0]), 8: statistics.median(timed[name][1])},
             statistics.median(timed[name][2])) for name, (_, _, result, per_canvas) in figures.items()]
    ref = rows[0]
    head = ["setting", *TASKS, "all", "steps/canvas", "steps/token", "rows/token", "tok/s b1", "tok/s b8", "first text ms"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r, per_canvas, speed, ttft in rows:
        acc = [f"{r.correct.get(t, 0) / max(1, r.total.get(t, 0)):.3f}" for t in TASKS]
        print(f"| {name} | " + " | ".join(acc) + f" | {r.accuracy:.3f} | {per_canvas:.2f} | "
              f"{r.denoising_steps / max(1, r.tokens):.3f} | {r.rows / max(1, r.tokens):.2f} | "
              f"{speed[1]:.0f} | {speed[8]:.0f} | {ttft * 1000:.0f} |")
    print()
    _, r0, _, s0, t0 = ref
    for name, r, _, speed, ttft in rows[1:]:
        print(f"{name} against the seed's settings: rows/token {r0.rows / r0.tokens / (r.rows / r.tokens):.2f}x fewer, "
              f"steps/token {r0.denoising_steps / r0.tokens / (r.denoising_steps / r.tokens):.2f}x fewer, "
              f"tok/s {speed[1] / s0[1]:.2f}x (b1) {speed[8] / s0[8]:.2f}x (b8), first text {ttft / t0:.2f}x the time")


if __name__ == "__main__":
    main()
