"""`blockdiff quantize (--fp8-dynamic | --scheme w8a16|w4a16|mixed) SRC DST`: write a compressed-tensors checkpoint."""

from __future__ import annotations

import argparse
import os

SCHEMES = ("w8a16", "w4a16", "mixed")  # model/quantize_int.py's, named here so --help needs no import of it
GROUP_SIZE = 128


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a quantized (compressed-tensors) checkpoint of a bfloat16/float32 one")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument(
        "--fp8-dynamic",
        action="store_true",
        help="FP8 E4M3 weights with per-channel scales, activations quantized per token at run time "
        "(the published DiffusionGemma FP8-dynamic scheme and ignore list)",
    )
    kind.add_argument(
        "--scheme",
        choices=SCHEMES,
        help="integer weights only, pack-quantized as llm-compressor writes them: w8a16 int8 per-channel, w4a16 "
        "int4 in groups of --group-size, mixed the experts in int4 and every other linear layer in int8 "
        "(symmetric; routers, embeddings, LM head, self-conditioning and vision tower stay as they are)",
    )
    p.add_argument("--group-size", type=int, default=GROUP_SIZE,
                   help="input columns per int4 scale (w4a16 and mixed); each quantized layer's width must be a multiple of it")
    p.add_argument("src", help="checkpoint directory to read")
    p.add_argument("dst", help="directory to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from blockdiff.model.quantize import quantize_checkpoint
    from blockdiff.model.registry import load_config

    load_config(args.src)  # refuse what blockdiff cannot run before writing anything
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        raise ValueError("dst must differ from src")
    if args.group_size <= 0:
        raise ValueError(f"--group-size must be positive, not {args.group_size}")
    if args.scheme is None:
        print(f"wrote {quantize_checkpoint(args.src, args.dst)}")
        return 0
    from blockdiff.model.quantize_int import IntWriter, int_config

    scheme = IntWriter(int_config(args.scheme, args.group_size))
    print(f"wrote {quantize_checkpoint(args.src, args.dst, scheme)}")
    return 0
