"""What a user brings from vLLM, mapped onto blockdiff's own settings, for the command line
(`arg_utils`) and `LLM(...)` alike: the engine options that mean nothing here (accepted with a
warning, or refused where ignoring them would change what the user gets), and vLLM's diffusion
settings, `--diffusion-config` and the diffusion keys of `--hf-overrides`.

    --diffusion-config '{"canvas_length": 256, "max_denoising_steps": 16}'
        canvas_length -> EngineConfig.canvas_length (--canvas-length)
        max_denoising_steps -> the sampler default (--max-denoising-steps)
    --hf-overrides '{"diffusion_sampler": "entropy_bound", "diffusion_entropy_bound": 0.1,
                     "diffusion_confidence_threshold": 0.0}'
        diffusion_sampler -> EngineConfig.diffusion_sampler (--diffusion-sampler)
        diffusion_FIELD -> the sampler default of FIELD (--FIELD), for every field of a sampler's table
        canvas_length -> config.json's canvas length, as above

Any other key is refused with the blockdiff flag to use, or with why there is none.
"""

from __future__ import annotations

import logging

from blockdiff.config import json_object
from blockdiff.diffusion.registry import SAMPLERS

log = logging.getLogger("blockdiff")

# vLLM engine options that mean nothing here: (name, type of a flag's value or None for a switch, why).
ACCEPTED = (
    ("gpu_memory_utilization", float, "the KV cache is sized by --kv-cache-memory instead"),
    ("swap_space", float, "the KV cache is never swapped to host memory"),
    ("enable_chunked_prefill", None, "prefill is always chunked (--max-num-batched-tokens per step)"),
    ("trust_remote_code", None, "blockdiff never runs code from a checkpoint"),
    ("tokenizer_mode", str, "the checkpoint's tokenizer.json is read with the tokenizers library, whatever the mode"),
    ("disable_log_stats", None, "blockdiff logs no periodic statistics; /metrics has them"),
    ("enable_auto_tool_choice", None, "tool calls are read whenever the checkpoint's format is known "
                                      "(--tool-call-parser)"),
)
REFUSED = (
    (("--pipeline-parallel-size", "-pp"), "pipeline parallelism is not implemented; use --tensor-parallel-size"),
    (("--quantization", "-q"), "the quantization is read from the checkpoint's quantization_config "
                               "(compressed-tensors FP8, docs/fp8.md); there is nothing to choose"),
    (("--speculative-config",), "there is no speculative decoding; canvases are denoised in parallel already"),
)
# vLLM's DiffusionConfig's keys (--canvas-length, --max-denoising-steps here).
DIFFUSION_CONFIG_KEYS = ("canvas_length", "max_denoising_steps")
# Keys of config.json that --hf-overrides could otherwise change, and the blockdiff flag to use instead.
_HF_KEYS_WITH_FLAGS = {
    "max_position_embeddings": "--max-model-len",
    "torch_dtype": "--dtype",
    "dtype": "--dtype",
    "num_hidden_layers": "--num-layers-override (with --load-format dummy)",
}


def warn_ignored(name: str) -> None:
    """The warning for an accepted vLLM option `name` (as a field name) that the user set."""
    reason = next(why for n, _, why in ACCEPTED if n == name)
    log.warning("--%s is ignored: %s", name.replace("_", "-"), reason)


def refused_reason(name: str) -> str | None:
    """Why vLLM option `name` (a field name) is refused, or None if it is not."""
    flag = "--" + name.replace("_", "-")
    return next((why for flags, why in REFUSED if flag in flags), None)


def _sampler_fields() -> dict[str, type]:
    return {f.name: f.type for s in SAMPLERS.values() for f in s.fields}


def _check_type(what: str, value, kind: type):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ValueError(f"{what} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def diffusion_settings(diffusion_config: str | dict | None, hf_overrides: str | dict | None) -> tuple[dict, dict]:
    """vLLM's --diffusion-config and --hf-overrides -> (EngineConfig fields, sampler defaults by field
    name). ValueError for a key blockdiff has no meaning for, naming the flag to use."""
    engine, sampler = {}, {}
    fields = _sampler_fields()
    for key, value in json_object(diffusion_config, "--diffusion-config").items():
        if key == "canvas_length":
            engine["canvas_length"] = _positive_int("--diffusion-config canvas_length", value)
        elif key == "max_denoising_steps":
            if value is not None:  # vLLM's None: the checkpoint's generation_config.json
                sampler["max_denoising_steps"] = _positive_int("--diffusion-config max_denoising_steps", value)
        else:
            hint = (f"; use --{key.replace('_', '-')}" if key in fields else "")
            raise ValueError(f"--diffusion-config key {key!r} is not one of vLLM's "
                             f"({', '.join(DIFFUSION_CONFIG_KEYS)}){hint}")
    for key, value in json_object(hf_overrides, "--hf-overrides").items():
        field = key.removeprefix("diffusion_")
        if key == "diffusion_sampler":
            if value not in SAMPLERS:
                raise ValueError(f"--hf-overrides diffusion_sampler must be one of {', '.join(SAMPLERS)}, got {value!r}")
            engine["diffusion_sampler"] = value
        elif key == "canvas_length":
            engine["canvas_length"] = _positive_int("--hf-overrides canvas_length", value)
        elif key.startswith("diffusion_") and field in fields:
            sampler[field] = _check_type(f"--hf-overrides {key}", value, fields[field])
        elif key.startswith("diffusion_"):
            raise ValueError(f"--hf-overrides key {key!r} is not a diffusion setting blockdiff knows: it takes "
                             f"diffusion_sampler and diffusion_ followed by a sampler field "
                             f"({', '.join(fields)})")
        else:
            flag = _HF_KEYS_WITH_FLAGS.get(key)
            instead = f"use {flag}" if flag else "no blockdiff flag changes it"
            raise ValueError(f"--hf-overrides key {key!r} is not supported: blockdiff reads the checkpoint's "
                             f"config.json as it is ({instead}); the diffusion keys are diffusion_sampler and "
                             f"diffusion_<sampler field>")
    return engine, sampler


def _positive_int(what: str, value) -> int:
    n = _check_type(what, value, int)
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {value!r}")
    return n


def engine_keywords(options: dict) -> dict:
    """`LLM(...)`'s keywords as EngineConfig fields: vLLM's options that mean nothing here dropped with
    the command line's warning, refused ones a ValueError with the reason, max_num_batched_tokens
    under its name here (max_prefill_tokens), and diffusion_config / hf_overrides mapped as their
    flags are, and the samplers' fields taken as the server's flags are (into sampling_defaults)."""
    out = dict(options)
    for name, _, _ in ACCEPTED:
        if name in out:
            value = out.pop(name)
            if value not in (None, False):
                warn_ignored(name)
    for name in list(out):
        reason = refused_reason(name)
        if reason is not None and out[name] is not None:
            raise ValueError(f"{name} is not supported: {reason}")
        if reason is not None:
            del out[name]
    if "max_num_batched_tokens" in out:
        if "max_prefill_tokens" in out:
            raise ValueError("max_num_batched_tokens and max_prefill_tokens are the same setting; give one")
        out["max_prefill_tokens"] = out.pop("max_num_batched_tokens")
    engine, sampler = diffusion_settings(out.pop("diffusion_config", None), out.pop("hf_overrides", None))
    # the samplers' fields (denoising_mode="fast", ...) as keywords: defaults, as the server's flags are
    sampler.update({name: out.pop(name) for name in _sampler_fields() if name in out})
    for name, value in engine.items():
        if out.get(name) is not None and out[name] != value:
            raise ValueError(f"{name}={out[name]!r} disagrees with {value!r} from diffusion_config / hf_overrides")
        out[name] = value
    if sampler:
        out["sampling_defaults"] = {**sampler, **out.get("sampling_defaults", {})}
    return out
