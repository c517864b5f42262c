"""`blockdiff quantize --fp8-dynamic SRC DST`: write a compressed-tensors FP8 checkpoint."""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write an FP8 (compressed-tensors) checkpoint of a bfloat16/float32 one")
    p.add_argument(
        "--fp8-dynamic",
        action="store_true",
        required=True,
        help="FP8 E4M3 weights with per-channel scales, activations quantized per token at run time "
        "(the published DiffusionGemma FP8-dynamic scheme and ignore list)",
    )
    p.add_argument("src", help="checkpoint directory to read")
    p.add_argument("dst", help="directory to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blockdiff.model.registry import load_config
    from blockdiff.model.quantize import quantize_checkpoint

    load_config(args.src)  # refuse what blockdiff cannot run before writing anything
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise ValueError("dst must differ from src")
    print(f"wrote {quantize_checkpoint(args.src, args.dst)}")
    return 0
