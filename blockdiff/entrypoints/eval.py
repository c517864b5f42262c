"""`blockdiff eval --task demo`: accuracy on held-out demo problems and tokens per denoising step."""

from __future__ import annotations

import argparse
import dataclasses

from blockdiff.arg_utils import add_chat_template_arg, add_engine_args, add_sampling_args, engine_config, sampling_params

TASK_SETS = ("demo", "demo-agent")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="measure task accuracy on held-out problems")
    p.add_argument("--task", required=True, choices=TASK_SETS, help="demo: sorting, reversal and upper-casing problems; demo-agent: the demo's weather tool and thinking problems")
    p.add_argument("--num", type=int, default=100, help="held-out problems to ask")
    p.add_argument("--problem-seed", type=int, default=None, help="draw other held-out problems (default: the fixed evaluation set)")
    add_engine_args(p)
    add_chat_template_arg(p)
    add_sampling_args(p)
    # Every problem runs at once; short sequences keep that batch's KV cache small.
    p.set_defaults(max_num_seqs=128, max_model_len=384, func=run)


def run(args: argparse.Namespace) -> int:
    from blockdiff.demo.evaluate import evaluate
    from blockdiff.demo.tasks import AGENT_TASKS, EVAL_SEED, TASKS, heldout_problems
    from blockdiff.llm import LLM

    tasks = AGENT_TASKS if args.task == "demo-agent" else TASKS
    problems = heldout_problems(args.num, EVAL_SEED if args.problem_seed is None else args.problem_seed, tasks)
    params = sampling_params(args)
    llm = LLM(**dataclasses.asdict(engine_config(args)))
    try:
        result = evaluate(llm, problems, params, seed=args.seed)
    finally:
        llm.shutdown()
    for line in result.lines():
        print(line)
    return 0
