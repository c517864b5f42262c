"""Command-line flags shared by the commands that run a model: engine flags and sampler flags."""

from __future__ import annotations

import argparse

from blockdiff.engine.engine import EngineConfig
from blockdiff.sampling_params import SamplingParams

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


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


positive_seconds.__name__ = "seconds"


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
    p.add_argument("--worker-timeout", type=positive_seconds, default=EngineConfig.worker_timeout,
                   help="seconds a tensor-parallel worker may not answer before it counts as lost and the workers "
                        "restart (default %(default)s)")


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
        worker_timeout=args.worker_timeout,
    )


_SAMPLER_FLAGS = [
    ("--max-tokens", int, "tokens to generate at most"),
    ("--max-denoising-steps", int, "denoising steps per canvas at most"),
    ("--entropy-bound", float, "accept tokens while Σentropy - max entropy stays below this"),
    ("--t-min", float, "temperature at the last denoising step"),
    ("--t-max", float, "temperature at the first denoising step"),
    ("--stability-threshold", int, "previous argmax canvases that must match to stop early"),
    ("--confidence-threshold", float, "mean entropy under which a stable canvas stops"),
]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampler defaults; unset ones come from the checkpoint's generation_config.json."""
    for flag, kind, text in _SAMPLER_FLAGS:
        p.add_argument(flag, type=kind, default=None, help=text)


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampler flags the user set, as SamplingParams fields."""
    out = {}
    for flag, _, _ in _SAMPLER_FLAGS:
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


def sampling_params(args: argparse.Namespace, **extra) -> SamplingParams:
    return SamplingParams(**sampling_overrides(args), **extra)
