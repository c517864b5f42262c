"""Command-line flags shared by the commands that run a model: engine flags and sampler flags."""

from __future__ import annotations

import argparse
import json
import logging
import os

from blockdiff.config import LOAD_FORMATS, EngineConfig
from blockdiff.hub import resolve_model
from blockdiff.sampling_params import SAMPLER_FIELDS, SamplingParams

log = logging.getLogger(__name__)

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


def positive(what: str):
    """argparse type: a finite number > 0; `what` names it in errors and in argparse's own."""

    def parse(text: str) -> float:
        value = float(text)
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be a {what} > 0, got {text}")
        return value

    parse.__name__ = what
    return parse


positive_seconds = positive("number of seconds")
positive_float = positive("number")


def port(text: str) -> int:
    """argparse type: a TCP port number (0 picks a free one)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


port.__name__ = "int"


def device(text: str) -> str:
    """argparse type: auto, cpu, cuda or cuda:N (whether this build can run it is checked at startup)."""
    from blockdiff.startup import check_device

    try:
        check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class _Refused(argparse.Action):
    """A vLLM flag whose feature does not exist here: refused with the reason, whatever its value."""

    def __init__(self, option_strings, dest, reason: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", help=f"refused: {reason}", **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"not supported: {self.reason}")


# vLLM engine flags that mean nothing here. Accepted ones are ignored with a warning at startup, so
# scripts written for vLLM run unchanged; refused ones would change what the user gets.
_ACCEPTED_VLLM_FLAGS = [
    ("--gpu-memory-utilization", float, "the KV cache is sized by --kv-cache-memory instead"),
    ("--swap-space", float, "the KV cache is never swapped to host memory"),
    ("--enable-chunked-prefill", None, "prefill is always chunked (--max-num-batched-tokens per step)"),
    ("--trust-remote-code", None, "blockdiff never runs code from a checkpoint"),
]
_REFUSED_VLLM_FLAGS = [
    (("--pipeline-parallel-size", "-pp"), "pipeline parallelism is not implemented; use --tensor-parallel-size"),
    (("--quantization", "-q"), "the quantization is read from the checkpoint's quantization_config "
                               "(compressed-tensors FP8, docs/fp8.md); there is nothing to choose"),
    (("--kv-cache-dtype",), "the KV cache is kept in the model's dtype"),
    (("--speculative-config",), "there is no speculative decoding; canvases are denoised in parallel already"),
]


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    model_help = "checkpoint directory or Hugging Face id in the local cache (default: the bundled demo model)"
    if model_positional:
        p.add_argument("model_tag", metavar="MODEL", nargs="?", default=None, help=model_help)
        model_help = "the same as MODEL"
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--tokenizer", default=None,
                   help="directory or Hugging Face id of the tokenizer (default: the model's own)")
    p.add_argument("--download-dir", default=None,
                   help="Hugging Face cache to look up model ids in (default: $HF_HUB_CACHE, else $HF_HOME/hub)")
    p.add_argument("--tensor-parallel-size", "-tp", type=at_least(1), default=EngineConfig.tensor_parallel_size,
                   help="processes the model is split over (gloo on CPU, one GPU each on CUDA)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations; auto takes the checkpoint's")
    p.add_argument("--device", type=device, default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    p.add_argument("--max-num-seqs", type=at_least(1), default=EngineConfig.max_num_seqs, help="requests that run at once")
    p.add_argument("--max-model-len", type=at_least(1), default=None,
                   help="prompt + max_tokens limit (default: min(8192, the model's max_position_embeddings))")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache budget, e.g. 512MiB (default: enough for max-num-seqs at max-model-len)")
    p.add_argument("--block-size", type=at_least(1), default=EngineConfig.block_size, help="tokens per KV cache block")
    p.add_argument("--max-num-batched-tokens", "--max-prefill-tokens", dest="max_prefill_tokens", type=at_least(1),
                   default=EngineConfig.max_prefill_tokens, help="prompt tokens prefilled per step")
    p.add_argument("--seed", type=int, default=EngineConfig.seed, help="engine seed: requests without a seed draw theirs from it")
    p.add_argument("--max-denoising-steps-limit", type=at_least(1), default=None,
                   help="largest max_denoising_steps (and stability_threshold) a request may ask for "
                        "(default: 4 x the canvas length, at least the checkpoint's default steps)")
    p.add_argument("--preempt-after-canvases", type=at_least(1), default=EngineConfig.preempt_after_canvases,
                   help="a running request that has committed this many canvases gives its slot to a waiting "
                        "request at its next canvas boundary, and is recomputed later")
    p.add_argument("--no-preemption", dest="preempt_after_canvases", action="store_const", const=None,
                   help="never preempt: requests wait first-come first-served")
    p.add_argument("--worker-timeout", type=positive_seconds, default=EngineConfig.worker_timeout,
                   help="seconds a tensor-parallel worker may not answer before it counts as lost and the workers "
                        "restart")
    p.add_argument("--sampler-memory-gb", type=positive_float, default=None,
                   help="GB the sampler may use beside the logits; it tiles over positions to stay within it "
                        "(default: an eighth of the free device memory, at most 1 GiB)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default=EngineConfig.load_format,
                   help="auto: the checkpoint's weights; dummy: random weights built from config.json alone")
    p.add_argument("--num-layers-override", type=at_least(1), default=None,
                   help="keep only the first N decoder layers (runs at real widths in less memory)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.enable_prefix_caching,
                   help="reuse the KV cache of full blocks of a prefix that an earlier request computed")
    add_image_args(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run steps of canvases only as one static step compiled with torch.compile "
                        "(default: the faster per device as measured: off on CPU, on on CUDA)")
    p.add_argument("--enforce-eager", action="store_true", default=EngineConfig.enforce_eager,
                   help="CUDA: no CUDA graphs for the static denoising steps (and no compile unless --compile)")
    vllm = p.add_argument_group("vLLM flags without meaning here (docs/server.md, 'vLLM flags')")
    for flag, kind, reason in _ACCEPTED_VLLM_FLAGS:
        if kind is None:
            vllm.add_argument(flag, action="store_true", default=None, help=f"ignored: {reason}")
        else:
            vllm.add_argument(flag, type=kind, default=None, help=f"ignored: {reason}")
    for flags, reason in _REFUSED_VLLM_FLAGS:
        vllm.add_argument(*flags, action=_Refused, reason=reason, default=argparse.SUPPRESS)


def limit_mm(text: str) -> int:
    """argparse type of --limit-mm-per-prompt: vLLM's JSON '{"image": N}' -> N."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or set(value) - {"image"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        raise argparse.ArgumentTypeError(f'expected JSON like \'{{"image": 2}}\' (images only), got {text!r}')
    return value.get("image", EngineConfig.limit_images_per_prompt)


def add_image_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("images (docs/images.md)")
    g.add_argument("--limit-mm-per-prompt", dest="limit_images_per_prompt", type=limit_mm,
                   default=EngineConfig.limit_images_per_prompt,
                   help=f'images one prompt may hold, as JSON: \'{{"image": N}}\' (default {EngineConfig.limit_images_per_prompt})')
    g.add_argument("--max-image-bytes", type=parse_size, default=EngineConfig.max_image_bytes,
                   help=f"largest encoded image, e.g. 8MiB (default {EngineConfig.max_image_bytes} bytes)")
    g.add_argument("--max-image-pixels", type=at_least(1), default=EngineConfig.max_image_pixels,
                   help=f"largest width x height of an image (default {EngineConfig.max_image_pixels})")
    g.add_argument("--max-image-decoded-bytes", type=parse_size, default=EngineConfig.max_image_decoded_bytes,
                   help="largest image decoded, at 4 bytes a pixel, checked from its header before decoding "
                        f"(default {EngineConfig.max_image_decoded_bytes} bytes)")
    g.add_argument("--allowed-media-domains", nargs="+", default=list(EngineConfig.allowed_media_domains), metavar="DOMAIN",
                   help="hosts whose http(s) image URLs may be fetched (default: none; data: URLs always work)")
    g.add_argument("--allowed-local-media-path", default=EngineConfig.allowed_local_media_path, metavar="DIR",
                   help="directory whose files file:// image URLs may name (default: none)")
    g.add_argument("--media-fetch-timeout", type=positive_seconds, default=EngineConfig.media_fetch_timeout,
                   help=f"seconds fetching an image URL may take in all (default {EngineConfig.media_fetch_timeout:g})")


def given_model(args: argparse.Namespace) -> str | None:
    """The model as the user wrote it (MODEL or --model), None for the demo."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"MODEL {tag!r} and --model {args.model!r} disagree; give one")
    return tag if tag is not None else args.model


def engine_config(args: argparse.Namespace) -> EngineConfig:
    for flag, _, reason in _ACCEPTED_VLLM_FLAGS:
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            log.warning("%s is ignored: %s", flag, reason)
    return EngineConfig(
        model=resolve_model(given_model(args), args.download_dir),
        tokenizer=None if args.tokenizer is None else resolve_model(args.tokenizer, args.download_dir),
        chat_template=read_chat_template(args.chat_template) if getattr(args, "chat_template", None) else None,
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
        max_denoising_steps_limit=args.max_denoising_steps_limit,
        preempt_after_canvases=args.preempt_after_canvases,
        enable_prefix_caching=args.enable_prefix_caching,
        limit_images_per_prompt=args.limit_images_per_prompt,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        max_image_decoded_bytes=args.max_image_decoded_bytes,
        allowed_media_domains=tuple(args.allowed_media_domains),
        allowed_local_media_path=args.allowed_local_media_path,
        media_fetch_timeout=args.media_fetch_timeout,
        compile=args.compile,
        enforce_eager=args.enforce_eager,
        sampler_memory_gb=args.sampler_memory_gb,
        load_format=args.load_format,
        num_layers_override=args.num_layers_override,
        tune_cpu_heap=True,  # a process that only runs blockdiff: its heap is ours to tune
    )


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None,
                   help="jinja2 chat template, a file or the template itself (default: the tokenizer's)")


def read_chat_template(value: str) -> str:
    """A file's contents, or the value itself when it is a template (vLLM's rule)."""
    if any(c in value for c in "{}\n"):
        return value
    if not os.path.isfile(value):
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja2 template")
    with open(value) as f:
        return f.read()


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampler defaults, one flag per field of the sampler-field table; unset ones come from the
    checkpoint's generation_config.json."""
    for f in SAMPLER_FIELDS:
        default = ("what fits in --max-model-len" if f.default is None else
                   f"generation_config.json, else {f.default}" if f.generation_config else str(f.default))
        p.add_argument("--" + f.name.replace("_", "-"), type=f.type, default=None, help=f"{f.help} (default: {default})")


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampler flags the user set, as SamplingParams fields."""
    return {f.name: getattr(args, f.name) for f in SAMPLER_FIELDS if getattr(args, f.name) is not None}


def sampling_params(args: argparse.Namespace, **extra) -> SamplingParams:
    return SamplingParams(**sampling_overrides(args), **extra)
