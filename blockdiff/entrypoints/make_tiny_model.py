"""`blockdiff make-tiny-model DIR`: write a random DiffusionGemma checkpoint."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

from blockdiff.model.tiny import TinySpec, make_tiny_model

_FLAGS = {
    "vocab_size": "vocabulary size (the tokenizer is trained to fit it)",
    "hidden_size": "hidden size",
    "intermediate_size": "dense MLP and self-conditioning MLP width",
    "num_layers": "layers",
    "num_heads": "attention heads",
    "num_kv_heads": "KV heads of sliding layers",
    "head_dim": "head dim of sliding layers",
    "global_head_dim": "head dim of full-attention layers",
    "num_global_kv_heads": "KV heads of full-attention layers",
    "num_experts": "experts",
    "top_k_experts": "experts per token",
    "moe_intermediate_size": "expert width",
    "sliding_window": "sliding window",
    "canvas_length": "canvas length",
    "seed": "random seed",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint in Hugging Face layout")
    p.add_argument("dir", help="where to write it: a new or empty directory (see --overwrite)")
    defaults = TinySpec()
    for name, text in _FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name), help=text)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-denoising-steps", type=int, default=None, help="written to generation_config.json")
    p.add_argument("--vision", action="store_true",
                   help="a multimodal checkpoint: a vision tower for image tests, image tokens, preprocessor_config.json")
    p.add_argument("--overwrite", action="store_true",
                   help="write into DIR even if it is not empty, replacing the files of a checkpoint there")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if os.path.isfile(args.dir):
        raise ValueError(f"{args.dir} is a file, not a directory")
    if os.path.isdir(args.dir) and os.listdir(args.dir) and not args.overwrite:
        what = "holds a checkpoint" if os.path.exists(os.path.join(args.dir, "config.json")) else "is not empty"
        raise ValueError(f"{args.dir} {what}; pass --overwrite to write the new checkpoint over it")
    spec = TinySpec(**{f.name: getattr(args, f.name) for f in fields(TinySpec) if f.name in _FLAGS}, dtype=args.dtype,
                    vision=args.vision)
    if args.max_denoising_steps is not None:
        spec.generation["max_denoising_steps"] = args.max_denoising_steps
    make_tiny_model(args.dir, spec)
    print(f"wrote {args.dir}")
    return 0
