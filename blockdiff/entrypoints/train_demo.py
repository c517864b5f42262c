"""`blockdiff train-demo`: train the demo model and write it as a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
import json
import os

from blockdiff.demo import CHECKPOINT_DIR
from blockdiff.arg_utils import at_least


def register(sub: argparse._SubParsersAction) -> None:
    from blockdiff.demo.train import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-demo", help="train the bundled demo model (CPU, seeded) on sorting, reversal, upper-casing and a weather tool")
    # Not the bundled checkpoint by default: a short experiment must not replace the model that
    # `blockdiff serve` and the docs use; replacing it takes `--out` with its path, on purpose.
    p.add_argument("--out", default="demo-checkpoint",
                   help=f"checkpoint directory to write; the bundled one is {CHECKPOINT_DIR}")
    p.add_argument("--steps", type=at_least(1), default=d.steps)
    p.add_argument("--batch-size", type=at_least(1), default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--warmup", type=at_least(0), default=d.warmup, help="warm-up steps (at most a tenth of the run)")
    p.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                   help="start from this demo checkpoint's weights (tokens added since keep random embeddings) "
                        "instead of random weights: a fine-tune")
    p.add_argument("--workers", type=at_least(1), default=d.workers,
                   help="data-parallel training processes, each with its share of every batch and of the threads "
                        "(docs/demo.md: 2 on a 2-core machine, with OMP_NUM_THREADS=1)")
    p.add_argument("--tasks", default=",".join(d.tasks), metavar="TASK,...",
                   help="the tasks to draw, in equal shares; name a task twice to draw it twice as often")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blockdiff.demo.tasks import AGENT_TASKS, TASKS
    from blockdiff.demo.train import TrainConfig, train_and_save

    if not args.lr > 0:
        raise ValueError(f"lr must be > 0, got {args.lr}")
    if args.init_from is not None and not os.path.isfile(os.path.join(args.init_from, "config.json")):
        raise ValueError(f"--init-from {args.init_from!r} is not a checkpoint directory (no config.json)")
    tasks = tuple(t.strip() for t in args.tasks.split(","))
    unknown = sorted(set(tasks) - set(TASKS + AGENT_TASKS))
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)}; the tasks are {', '.join(TASKS + AGENT_TASKS)}")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, warmup=args.warmup,
                      init_from=args.init_from, tasks=tasks, workers=args.workers)
    report = train_and_save(cfg, args.out)
    print(json.dumps(report, indent=2))
    print(f"wrote {os.path.abspath(args.out)}")
    return 0
