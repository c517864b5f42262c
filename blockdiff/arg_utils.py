"""Command-line flags shared by the commands that run a model (the `blockdiff` subcommands and the
benchmarks): engine flags, sampler flags and argparse types."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os

from blockdiff.config import EngineConfig, KVEventsConfig
from blockdiff.diffusion.registry import SAMPLERS
from blockdiff.hub import resolve_model, resolve_tokenizer
from blockdiff.sampling_params import ENGINE_FIELDS, SamplingParams
from blockdiff.vllm_options import ACCEPTED, REFUSED, diffusion_settings, warn_ignored

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
    from blockdiff.engine.startup import check_device

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
    groups: dict[str | None, argparse._ActionsContainer] = {None: p}
    for f in dataclasses.fields(EngineConfig):
        spec = f.metadata.get("flag")
        if spec is None:
            continue
        group = groups.get(spec.group) or groups.setdefault(spec.group, p.add_argument_group(spec.group))
        group.add_argument(*(spec.names or ("--" + f.name.replace("_", "-"),)), dest=f.name, default=f.default,
                           help=spec.help.replace("{samplers}", ", ".join(SAMPLERS)), **_flag_kind(f, spec))
        if spec.off is not None:
            group.add_argument(spec.off[0], dest=f.name, action="store_const", const=None, help=spec.off[1])
    diffusion = p.add_argument_group("vLLM's diffusion flags, mapped onto the flags above (docs/server.md, 'vLLM flags')")
    diffusion.add_argument("--diffusion-config", default=None, metavar="JSON",
                           help='vLLM\'s \'{"canvas_length": N, "max_denoising_steps": S}\': --canvas-length and '
                                '--max-denoising-steps')
    diffusion.add_argument("--hf-overrides", default=None, metavar="JSON",
                           help='vLLM\'s diffusion keys: \'{"diffusion_sampler": NAME, "diffusion_FIELD": value}\' '
                                'for --diffusion-sampler and the sampler flags (e.g. diffusion_entropy_bound); other '
                                'keys are refused')
    vllm = p.add_argument_group("vLLM flags without meaning here (docs/server.md, 'vLLM flags')")
    for name, kind, reason in ACCEPTED:
        flag = "--" + name.replace("_", "-")
        if kind is None:
            vllm.add_argument(flag, action="store_true", default=None, help=f"ignored: {reason}")
        else:
            vllm.add_argument(flag, type=kind, default=None, help=f"ignored: {reason}")
    for flags, reason in REFUSED:
        vllm.add_argument(*flags, action=_Refused, reason=reason, default=argparse.SUPPRESS)


def show_first(p: argparse.ArgumentParser, title: str, flags: list[str]) -> None:
    """--help shows `flags` (added already) in a group of their own right after the positionals,
    ahead of the hundred others, so that `--help | head` shows the flags most runs set. Only where
    their help is printed changes. argparse has no public way to move an argument to another group."""
    by_flag = {name: action for action in p._actions for name in action.option_strings}
    group = p.add_argument_group(title)
    for flag in flags:
        action = by_flag[flag]
        for other in p._action_groups:
            if action in other._group_actions:
                other._group_actions.remove(action)
        group._group_actions.append(action)
    p._action_groups.remove(group)
    p._action_groups.insert(1, group)  # after "positional arguments", before "options"


def limit_mm(text: str) -> dict:
    """argparse type of --limit-mm-per-prompt: vLLM's JSON '{"image": N, "video": M}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or set(value) - {"image", "video"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
        raise argparse.ArgumentTypeError(f'expected JSON like \'{{"image": 2, "video": 1}}\' (images and videos), got {text!r}')
    return value


def sampler_name(text: str) -> str:
    """argparse type: the name of a registered diffusion sampler."""
    if text not in SAMPLERS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(SAMPLERS)}, got {text!r}")
    return text

def trusted_proxies(text: str) -> tuple[str, ...]:
    """argparse type of --forwarded-allow-ips: comma-separated IP addresses and CIDR networks, or `*`
    (any peer). -> each written as uvicorn compares it (a network with host bits set would be no
    network to uvicorn, and would never match)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if "*" in items:
        return ("*",)
    out = []
    for item in items:
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)) if "/" in item else str(ipaddress.ip_address(item)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an IP address or a CIDR network (a comma-separated "
                                             "list of them, or *)") from None
    return tuple(out)


def kv_events_config(text: str) -> KVEventsConfig:
    """argparse type of --kv-events-config: vLLM's JSON."""
    try:
        return KVEventsConfig.of(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_PARSERS = {"kv_events": kv_events_config, "sampler": sampler_name, "size": parse_size, "positive": positive_float, "seconds": positive_seconds, "device": device, "mm_limits": limit_mm}


def _flag_kind(f: dataclasses.Field, spec) -> dict:
    """argparse's type, action, choices and metavar of an EngineConfig field, from its annotation
    (a string under `from __future__ import annotations`) and its `Flag`."""
    kind = {"metavar": spec.metavar} if spec.metavar else {}
    if spec.choices:
        kind["choices"] = spec.choices
    if f.type == "bool":
        return {"action": "store_true"} if f.default is False else {"action": argparse.BooleanOptionalAction}
    if f.type == "bool | None":
        return {"action": argparse.BooleanOptionalAction}
    if f.type.startswith("tuple[str"):
        return {**kind, "nargs": "+"}
    if spec.parse is not None:
        return {**kind, "type": _PARSERS[spec.parse]}
    if f.type.startswith("int"):
        return {**kind, "type": int if spec.minimum is None else at_least(spec.minimum)}
    if f.type.startswith("float"):
        return {**kind, "type": float}
    return kind


def given_model(args: argparse.Namespace) -> str | None:
    """The model as the user wrote it (MODEL or --model), None for the demo."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"MODEL {tag!r} and --model {args.model!r} disagree; give one")
    return tag if tag is not None else args.model


def _vllm_diffusion(args: argparse.Namespace) -> tuple[dict, dict]:
    """--diffusion-config and --hf-overrides as (EngineConfig fields, sampler flags); each must agree
    with the blockdiff flag of the same setting when both are given."""
    engine, sampler = diffusion_settings(getattr(args, "diffusion_config", None), getattr(args, "hf_overrides", None))
    for name, value in [*engine.items(), *sampler.items()]:
        given = getattr(args, name, None)
        if given is not None and given != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {given} disagrees with {value} from --diffusion-config / --hf-overrides; give one")
    return engine, sampler


def engine_config(args: argparse.Namespace) -> EngineConfig:
    for name, _, _ in ACCEPTED:
        if getattr(args, name) not in (None, False):
            warn_ignored(name)
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if "flag" in f.metadata}
    flags.update(_vllm_diffusion(args)[0])
    flags.update({name: tuple(value) for name, value in flags.items() if isinstance(value, list)})  # nargs flags
    return EngineConfig(
        model=resolve_model(given_model(args), args.download_dir),
        tokenizer=None if args.tokenizer is None else resolve_tokenizer(args.tokenizer, args.download_dir),
        chat_template=read_chat_template(args.chat_template) if getattr(args, "chat_template", None) else None,
        tune_cpu_heap=True,  # a process that only runs blockdiff: its heap is ours to tune
        **flags,
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
    """Sampler defaults, one flag per field of each registered sampler's table (a group per sampler,
    the fields every sampler has first); unset ones come from the checkpoint's generation_config.json.
    The engine refuses the flags of a sampler its model does not run."""
    seen = set()
    for name, sampler in [("every sampler", None), *SAMPLERS.items()]:
        group = p.add_argument_group(f"sampler flags: {name}" + (" (--diffusion-sampler)" if sampler else ""))
        for f in (ENGINE_FIELDS if sampler is None else sampler.fields):
            if f.name in seen:
                continue
            seen.add(f.name)
            default = ("what fits in --max-model-len" if f.default is None else
                       f"generation_config.json, else {f.default}" if f.generation_config else str(f.default))
            group.add_argument("--" + f.name.replace("_", "-"), type=f.type, default=None, choices=f.choices or None,
                               help=f"{f.help} (default: {default})")


def _sampler_field_names() -> list[str]:
    return list(dict.fromkeys(f.name for s in SAMPLERS.values() for f in s.fields))


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampler flags the user set (and those vLLM's --diffusion-config and --hf-overrides set),
    as fields of the samplers' tables."""
    flags = {name: getattr(args, name) for name in _sampler_field_names() if getattr(args, name) is not None}
    return {**flags, **_vllm_diffusion(args)[1]}


def sampling_params(args: argparse.Namespace, **extra) -> SamplingParams:
    return SamplingParams.of(**sampling_overrides(args), **extra)
