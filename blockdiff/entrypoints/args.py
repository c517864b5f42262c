"""Command-line flags shared by the commands that run a model: engine flags and sampler flags."""

from __future__ import annotations

import argparse

from blockdiff.config import EngineConfig
from blockdiff.sampling_params import SAMPLER_FIELDS, SamplingParams

_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
               "g": 2**30, "gb": 2**30, "gib": 2**30}


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1048576' -> bytes."""
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    if unit not in _SIZE_UNITS or not number:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB or 2GiB)")
    return int(float(number) * _SIZE_UNITS[unit])


def at_least(minimum: int):
    """argparse type: an integer >= `minimum` (argparse's error then names the flag)."""

    def parse(text: str) -> int:
        value = int(text)  # argparse reports a ValueError as "invalid int value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled demo model)")
    else:
        p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests that run at once")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + max_tokens limit (default: min(8192, model))")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache budget, e.g. 512MiB (default: enough for max-num-seqs at max-model-len)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-prefill-tokens", type=int, default=2048, help="prompt tokens prefilled per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-denoising-steps-limit", type=at_least(1), default=None,
                   help="largest max_denoising_steps (and stability_threshold) a request may ask for "
                        "(default: 4 x the canvas length)")
    p.add_argument("--preempt-after-canvases", type=at_least(1), default=4,
                   help="a running request that has committed this many canvases gives its slot to a waiting "
                        "request at its next canvas boundary, and is recomputed later")
    p.add_argument("--no-preemption", dest="preempt_after_canvases", action="store_const", const=None,
                   help="never preempt: requests wait first-come first-served")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    model = args.model
    if model is None:
        from blockdiff.demo import demo_checkpoint

        model = demo_checkpoint()
    return EngineConfig(
        model=model,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        max_prefill_tokens=args.max_prefill_tokens,
        seed=args.seed,
        max_denoising_steps_limit=args.max_denoising_steps_limit,
        preempt_after_canvases=args.preempt_after_canvases,
        tune_cpu_heap=True,  # a process that only runs blockdiff: its heap is ours to tune
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampler defaults, one flag per field of the sampler-field table; unset ones come from the
    checkpoint's generation_config.json."""
    for f in SAMPLER_FIELDS:
        p.add_argument("--" + f.name.replace("_", "-"), type=f.type, default=None,
                       help=f"{f.help} (default: generation_config.json, else {f.default})")


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampler flags the user set, as SamplingParams fields."""
    return {f.name: getattr(args, f.name) for f in SAMPLER_FIELDS if getattr(args, f.name) is not None}


def sampling_params(args: argparse.Namespace, **extra) -> SamplingParams:
    return SamplingParams(**sampling_overrides(args), **extra)
