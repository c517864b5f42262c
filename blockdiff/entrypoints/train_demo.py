"""`blockdiff train-demo`: train the demo model and write it as a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
import json
import os

from blockdiff.demo import CHECKPOINT_DIR
from blockdiff.entrypoints.args import at_least


def register(sub: argparse._SubParsersAction) -> None:
    from blockdiff.demo.train import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-demo", help="train the bundled demo model (CPU, seeded) on sorting, reversal and upper-casing")
    # Not the bundled checkpoint by default: a short experiment must not replace the model that
    # `blockdiff serve` and the docs use; replacing it takes `--out` with its path, on purpose.
    p.add_argument("--out", default="demo-checkpoint",
                   help=f"checkpoint directory to write; the bundled one is {CHECKPOINT_DIR}")
    p.add_argument("--steps", type=at_least(1), default=d.steps)
    p.add_argument("--batch-size", type=at_least(1), default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blockdiff.demo.train import TrainConfig, train_and_save

    if not args.lr > 0:
        raise ValueError(f"lr must be > 0, got {args.lr}")
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    report = train_and_save(cfg, args.out)
    print(json.dumps(report, indent=2))
    print(f"wrote {os.path.abspath(args.out)}")
    return 0
