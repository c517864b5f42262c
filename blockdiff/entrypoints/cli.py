"""`blockdiff` command line: each subcommand lives in its own module with a `register(subparsers)`.

Errors are one line, `error: ...`: exit code 2 for usage errors (flags, and values the code
refuses with ValueError), 1 for runtime failures (files, network, ports), 130 for Ctrl-C. A
traceback is printed only with `--log-level debug`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = [
    "blockdiff.entrypoints.bench",
    "blockdiff.entrypoints.chat",
    "blockdiff.entrypoints.generate",
    "blockdiff.entrypoints.make_tiny_model",
    "blockdiff.entrypoints.quantize",
    "blockdiff.entrypoints.serve",
    "blockdiff.entrypoints.train_demo",
    "blockdiff.entrypoints.eval",
]
LOG_LEVELS = ["debug", "info", "warning", "error"]


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help, unless there is none or the help names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not unset and "default" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """Usage errors as one `error:` line pointing to --help (subcommands inherit this class). Long
    flags must be spelled out: a prefix such as `--max-num-seq` would silently take `--max-num-seqs`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args=None, namespace=None):
        # argparse reports a subcommand's unknown flags from the top parser: remember whose they are.
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not hasattr(namespace, "_unknown_to"):
            namespace._unknown_to = self.prog
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        prog = vars(namespace).pop("_unknown_to", self.prog)
        if extras:
            self.exit(2, f"error: unrecognized arguments: {' '.join(extras)} (see `{prog} --help`)\n")
        return namespace


def _add_log_level(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default=default,
                        help="log level; debug also prints tracebacks (default: info)")


def build_parser() -> argparse.ArgumentParser:
    from blockdiff import __version__

    parser = Parser(prog="blockdiff", description="Serve and run block-diffusion language models.")
    parser.add_argument("--version", action="version", version=f"blockdiff {__version__}")
    _add_log_level(parser, "info")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    # --log-level also after the subcommand (vLLM's place for it); SUPPRESS keeps the global one.
    stack = list(sub.choices.values())
    while stack:
        p = stack.pop()
        _add_log_level(p, argparse.SUPPRESS)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += action.choices.values()
    return parser


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args is None:  # failed before the flags were read: a bug, so show where
            raise
        if args.log_level == "debug":
            logging.getLogger("blockdiff").exception("the command failed")
        print(f"error: {_message(e)}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1


def _message(e: Exception) -> str:
    """The exception's text on one line; its type where the text alone says too little."""
    text = " ".join(str(e).split())
    if isinstance(e, (ValueError, OSError, RuntimeError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
