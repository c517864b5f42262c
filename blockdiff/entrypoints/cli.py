"""`blockdiff` command line: each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = [
    "blockdiff.entrypoints.bench",
    "blockdiff.entrypoints.generate",
    "blockdiff.entrypoints.make_tiny_model",
    "blockdiff.entrypoints.quantize",
    "blockdiff.entrypoints.serve",
    "blockdiff.entrypoints.train_demo",
    "blockdiff.entrypoints.eval",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockdiff", description="Serve and run block-diffusion language models.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
