"""`blockdiff generate "prompt" ...`: offline generation from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json

from blockdiff.arg_utils import add_chat_template_arg, add_engine_args, add_sampling_args, engine_config, sampling_params


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts and print them")
    p.add_argument("prompts", nargs="+", help="prompt strings")
    add_engine_args(p)
    add_chat_template_arg(p)
    add_sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--draft", type=token_ids, default=None, help="comma-separated token ids that seed the canvases")
    p.add_argument("--seed-per-request", type=int, default=None, help="sampling seed of every request")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print each RequestOutput as JSON")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file for every prompt (repeat for several): with --chat it comes before the "
                        "message's text; without, each prompt holds one image placeholder token per image")
    p.add_argument("--video", action="append", default=[], metavar="PATH",
                   help="a video file for every prompt (repeat for several), placed as --image places images, after "
                        "them")
    p.set_defaults(func=run)


def token_ids(text: str) -> list[int]:
    """argparse type: '1,2,3' -> [1, 2, 3]."""
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids, e.g. 5,17,2") from None


def run(args: argparse.Namespace) -> int:
    from blockdiff.llm import LLM

    params = sampling_params(args, seed=args.seed_per_request, draft=args.draft, ignore_eos=args.ignore_eos)
    llm = LLM(**dataclasses.asdict(engine_config(args)))
    try:
        if llm.tokenizer is None:
            raise ValueError(f"{llm.engine.cfg.model} has no tokenizer.json, so text prompts cannot be encoded: "
                             "pass --tokenizer with the directory of its tokenizer")
        parts = [{"type": "image", "image": path} for path in args.image] + [
            {"type": "video", "video": path} for path in args.video]
        media = {m: paths for m, paths in (("image", args.image), ("video", args.video)) if paths}
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": [*parts, {"type": "text", "text": p}] if parts else p}]
                                for p in args.prompts], params)
        elif media:
            outputs = llm.generate([{"prompt": p, "multi_modal_data": media} for p in args.prompts], params)
        else:
            outputs = llm.generate(args.prompts, params)
    finally:
        llm.shutdown()
    for out in outputs:
        if args.json:
            print(json.dumps(out.to_dict()))
        else:
            print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
    return 0
