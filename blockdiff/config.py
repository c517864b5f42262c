"""Configuration: what the engine needs of a model (`ModelConfig`, which each architecture's parser
fills from its checkpoint's config.json, model/registry.py) and how the engine runs it
(`EngineConfig`, with its command-line flags)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from blockdiff.ops.cpu import BF16_CPU_FEATURES, cpu_features
from blockdiff.step import AdapterPool

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

class ConfigError(ValueError):
    """A checkpoint configuration blockdiff cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """What the engine, the KV cache and the worker need of a model, whatever its architecture; the
    architecture's own configuration (head dims, experts, RoPE, ...) is `arch`, which only its model
    code reads."""

    architecture: str  # config.json's `architectures` name (model/registry.py)
    vocab_size: int
    hidden_size: int  # a token's hidden state (the self-conditioning input)
    canvas_length: int
    windows: tuple[int | None, ...]  # per layer: a sliding layer's window (positions a query sees, itself included); None: full
    encoder_causal: bool  # the encoder's K/V of a token depend on the tokens before it only (prefix caching)
    max_position_embeddings: int
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    arch: Any  # the architecture's parsed config, with `first_layers(n)`
    # The image encoder (the architecture's: DiffusionGemma's model/gemma_config.VisionConfig, whose
    # placeholder ids and patch sizes the engine's multimodal intake reads); None: a text-only checkpoint
    vision: Any = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def sliding_window(self) -> int | None:
        return next((w for w in self.windows if w is not None), None)

    def first_layers(self, n: int) -> "ModelConfig":
        """This config with its first n layers only (--num-layers-override)."""
        if n > self.num_layers:
            raise ConfigError(f"num_layers_override {n} exceeds the model's {self.num_layers} layers")
        return replace(self, windows=self.windows[:n], arch=self.arch.first_layers(n))

    def window_past(self, max_model_len: int) -> int:
        """Cached positions a sliding layer reads: the window's past, or the whole sequence if shorter."""
        window = self.sliding_window
        return max(1, min(window - 1, max_model_len)) if window else 1


def dtype_of(name: str) -> torch.dtype:
    """A config.json dtype name (float32, bfloat16, ...) as a torch dtype."""
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}")
    return _DTYPES[name]


def read_config_json(path: str) -> dict:
    """path/config.json, or `path` itself when it is a JSON file (a config alone, for dummy weights)."""
    config_path = path if os.path.isfile(path) and path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"no config.json in {path!r}")
    return read_json(config_path)


def json_object(text: str | dict | None, what: str) -> dict:
    """A JSON object given as text (a flag) or as a dict (LLM's keyword); ValueError naming `what`."""
    if text is None:
        return {}
    try:
        return _object(text) if isinstance(text, str) else _object_or_error(text)
    except ValueError as e:
        raise ValueError(f"{what} must be a JSON object ({e}), got {text!r}") from None


def _object(text: str) -> dict:
    """`text` parsed as a JSON object; ValueError saying what it is instead."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    return _object_or_error(value)


def _object_or_error(value) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"a {type(value).__name__}, not an object")
    return value


def read_json(path: str) -> dict:
    """A checkpoint's JSON file; a ConfigError names the file and where it is broken."""
    with open(path) as f:
        text = f.read()
    try:
        return _object(text)
    except ValueError as e:
        raise ConfigError(f"{path} is {e}") from None


def choose_dtype(name: str | torch.dtype, config: ModelConfig, device: str = "cpu",
                 features: tuple[str, ...] | None = None) -> tuple[torch.dtype, str]:
    """(the dtype the model runs, why) from the user's choice. "auto" takes the checkpoint's, except
    a bfloat16 checkpoint on a CPU without AMX or AVX512-BF16 (`features`: the CPU's, default this
    one's), which runs float32: there every bfloat16 product converts to float32 and runs slower
    than float32 itself."""
    if isinstance(name, torch.dtype):
        return name, "asked"
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
        return _DTYPES[name], "asked"
    if config.dtype != torch.bfloat16 or not device.startswith("cpu"):
        return config.dtype, "the checkpoint's"
    have = [f for f in (cpu_features() if features is None else features) if f in BF16_CPU_FEATURES]
    if have:
        return torch.bfloat16, f"the checkpoint's; the CPU has {have[0]}"
    return torch.float32, "the checkpoint is bfloat16, but the CPU has neither AMX nor AVX512-BF16"


def parse_dtype(name: str | torch.dtype, config: ModelConfig, device: str = "cpu") -> torch.dtype:
    """Resolve a user's dtype choice on `device` (`choose_dtype`)."""
    return choose_dtype(name, config, device)[0]


# Denoising steps a steady-state step runs back to back unless the user says, per device type: on
# the CPU the K measured best (docs/benchmarks.md, "The host's share of a denoising step"); on CUDA one until a
# device measures K (scripts/device_check.py's steps_per_launch part).
STEPS_PER_LAUNCH = {"cpu": 4, "cuda": 1}
# Async scheduling per device (docs/benchmarks.md, "Scheduling overlapped with execution"): on a CPU the model computes on the
# host, so the overlap buys nothing there and the two thread wake-ups a step cost more; a GPU
# computes while the host makes and streams the outputs.
ASYNC_SCHEDULING = {"cpu": False, "cuda": True}

LOAD_FORMATS = ("auto", "dummy")
PREFIX_CACHE_SCOPES = ("client", "global")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# The attention backends' names (blockdiff/model/attention_backends), as vLLM's --attention-backend takes them.
ATTENTION_BACKEND_CHOICES = ("auto", "reference", "triton")
# vLLM's --kv-cache-dtype values that blockdiff runs: auto, the model's dtype; fp8 and fp8_e4m3, the
# same thing (float8_e4m3fn entries with per-layer scales; docs/fp8.md, "FP8 KV cache").
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3")
# vLLM's --logprobs-mode: what a generated token's logprob (and its alternatives') reports. raw: the
# model's own distribution, before the temperature; processed: the temperature-scaled one the
# sampler drew from; *_logits: the logit values instead of log-probabilities. The first is the default.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class Flag:
    """How an EngineConfig field is spelled on the command line (blockdiff/arg_utils.py builds the
    flags from these): its help, and where `--field-name` with the field's type is not enough, its
    other names, its lower bound, how its text is read or a second flag that sets it to None."""

    help: str
    names: tuple[str, ...] = ()  # the flag's spellings, the first shown in errors; default: --field-name
    minimum: int | None = None  # integers: the smallest accepted
    # "size" (512MiB), "positive" (a number > 0), "seconds", "device", "images" ('{"image": N}'),
    # "sampler" (a registered sampler's name, which the help's {samplers} lists)
    parse: str | None = None
    choices: tuple[str, ...] | None = None
    off: tuple[str, str] | None = None  # (flag, help) of a flag that sets the field to None
    metavar: str | None = None
    group: str | None = None  # a titled group of flags in --help


def flag(default, help: str, **kwargs):
    """A field with its command-line flag (`Flag`)."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(**factory, metadata={"flag": Flag(help, **kwargs)})


_IMAGES = "images (docs/images.md)"
_SCALING = "replicas and routers (docs/scaling.md)"
_LORA = "LoRA adapters (docs/lora.md)"

KV_EVENT_ENCODINGS = ("map", "array")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (`--kv-events-config`): whether and where the engine publishes its KV
    cache events (engine/kv_events.py), with vLLM's names and defaults, and keys of ours (marked)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when events are enabled
    # PUB socket; bound with a wildcard host (or ipc://), else connected. None (the default):
    # tcp://<bind_host>:5557, bound, so that events (which carry every client's token ids) stay on
    # the address the server listens on; vLLM's default is tcp://*:5557.
    endpoint: str | None = None
    replay_endpoint: str | None = None  # ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches queued for the publisher thread
    topic: str = ""
    # How each event is written: "map" (named fields, vLLM since 0.24) or "array" (positional,
    # vLLM 0.11 to 0.23, for consumers that decode only that). The batch is an array in both.
    encoding: str = "map"
    bind_host: str = "127.0.0.1"  # ours: the default endpoint's address (`serve` sets its --host)
    # Ours: CURVE on both sockets (kv_events.py). A directory of the routers' public keys
    # (zmq.auth's *.key files): only peers holding one of their secret keys get anything.
    curve_clients_dir: str | None = None
    # Ours: the server's key pair (zmq.auth's .key_secret file); None: a new one at each start,
    # its public key in the log.
    curve_server_secret_key_file: str | None = None
    # Ours: `serve` sets it with --api-key, which then covers the events too: they are published
    # only with CURVE, never in clear.
    require_curve: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("topic", "bind_host"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("endpoint", "replay_endpoint", "curve_clients_dir", "curve_server_secret_key_file"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(KV_EVENT_ENCODINGS)}, got {self.encoding!r}")
        if not isinstance(self.require_curve, bool):
            raise ValueError(f"require_curve must be true or false, got {self.require_curve!r}")
        if self.curve_server_secret_key_file is not None and self.curve_clients_dir is None:
            raise ValueError("curve_server_secret_key_file needs curve_clients_dir, the routers' public keys")
        if self.publishes and self.require_curve and self.curve_clients_dir is None:
            raise ValueError("kv_events_config: with --api-key, KV events (every client's prompt tokens) are published "
                             "only to routers that authenticate with CURVE: set curve_clients_dir to a directory of "
                             "their public keys (docs/scaling.md, \"Who can read them\")")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def of(cls, value: "KVEventsConfig | dict | str") -> "KVEventsConfig":
        """From vLLM's JSON text, a dict of its keys, or itself; ValueError names an unknown key."""
        if isinstance(value, cls):
            return value
        value = json_object(value, "kv_events_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class EngineConfig:
    """How the engine runs a model: read once at the edge (CLI, `LLM(...)`) and passed down. Each
    engine default is written here and nowhere else, and so is each engine flag (`Flag`)."""

    model: str
    tensor_parallel_size: int = flag(1, "processes the model is split over (gloo on CPU, one GPU each on CUDA)",
                                     names=("--tensor-parallel-size", "-tp"), minimum=1)
    # Engine replicas, each a process with its own tensor-parallel group (engine/dp_client.py).
    data_parallel_size: int = flag(1, "engine replicas behind one front end, each with its own tensor-parallel group "
                                      "(replica r on GPUs r x TP to r x TP + TP - 1; on the CPU, processes sharing "
                                      "the cores); requests go to the replica that caches their prefix, else the "
                                      "least loaded", names=("--data-parallel-size", "-dp"), minimum=1, group=_SCALING)
    # This engine is replica `data_parallel_rank` of data_parallel_size (external load balancing, or
    # a replica of the front end): it names the engine in /metrics and in its KV events, offsets
    # their ports, and offsets the seed drawn for requests that bring none.
    data_parallel_rank: int | None = flag(None, "run only replica RANK of --data-parallel-size, for a load balancer "
                                                "of your own in front of one server per rank: it offsets the KV "
                                                "events' ports and names the engine in /metrics and its events",
                                          minimum=0, metavar="RANK", group=_SCALING)
    kv_events_config: KVEventsConfig | None = flag(
        None, 'publish the KV cache\'s block events as vLLM does (ZMQ, msgpack), for KV-aware routers; JSON with '
              'vLLM\'s keys, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
        parse="kv_events", metavar="JSON", group=_SCALING)
    dtype: str = flag("auto", "weights and activations; auto takes the checkpoint's", choices=DTYPE_CHOICES)
    device: str = flag("auto", "auto (cuda if available), cpu, cuda or cuda:N", parse="device")
    # Chosen once per worker from the device and dtype (model/attention_backends: choose_attention_backend).
    attention_backend: str = flag("auto", "attention kernels: auto (triton on CUDA where triton imports, else "
                                          "reference), reference (exact, tuned for the CPU) or triton (CUDA)",
                                  choices=ATTENTION_BACKEND_CHOICES)
    max_num_seqs: int = flag(16, "requests that run at once", minimum=1)
    max_model_len: int | None = flag(None, "prompt + max_tokens limit (default: min(8192, the model's "
                                           "max_position_embeddings))", minimum=1)
    # bytes for full-attention blocks; None: enough for max_num_seqs at max_model_len
    kv_cache_memory: int | None = flag(None, "KV cache budget, e.g. 512MiB (default: enough for max-num-seqs at "
                                             "max-model-len)", parse="size")
    block_size: int = flag(16, "tokens per KV cache block", minimum=1)
    kv_cache_dtype: str = flag("auto", "KV cache entries: auto (the model's dtype) or fp8 / fp8_e4m3 (one byte each, "
                                       "float8_e4m3fn with a K and a V scale per layer: the checkpoint's k_scale / "
                                       "v_scale, else 1.0, or --calculate-kv-scales)", choices=KV_CACHE_DTYPE_CHOICES)
    calculate_kv_scales: bool = flag(False, "with an fp8 KV cache: each layer's K and V scales from the first "
                                            "prefill's K/V (max |x| / 200 and / 100, vLLM's), then fixed")
    max_prefill_tokens: int = flag(2048, "prompt tokens prefilled per step",
                                   names=("--max-num-batched-tokens", "--max-prefill-tokens"), minimum=1)
    seed: int = flag(0, "engine seed: requests without a seed draw theirs from it")
    tokenizer: str | None = None  # tokenizer directory; None: the model's
    chat_template: str | None = None  # overrides the tokenizer's
    max_denoising_steps_limit: int | None = flag(
        None, "largest max_denoising_steps (and stability_threshold) a request may ask for (default: 4 x the canvas "
              "length, at least the checkpoint's default steps)", minimum=1)
    # A running request that has committed this many canvases since it was admitted gives its slot to
    # a waiting request at its next canvas boundary (and is recomputed later); None: never.
    preempt_after_canvases: int | None = flag(
        4, "a running request that has committed this many canvases gives its slot to a waiting request at its next "
           "canvas boundary, and is recomputed later", minimum=1,
        off=("--no-preemption", "never preempt: requests wait first-come first-served"))
    # Full blocks of committed tokens stay cached and are reused by requests that share the prefix
    # (engine/kv_cache_manager.py).
    enable_prefix_caching: bool = flag(True, "reuse the KV cache of full blocks of a prefix that an earlier request "
                                             "computed")
    # Whose requests share cached prefixes: a client's own (its address; or requests of one
    # cache_salt), so that cached_tokens reveals nothing across tenants; "global": every request's.
    prefix_cache_scope: str = flag("client", "whose requests share cached prefixes: client (each client's own, and "
                                             "requests of the same cache_salt) or global (every request's)",
                                   choices=PREFIX_CACHE_SCOPES)
    tune_cpu_heap: bool = False  # see worker/cpu_heap.py: a process-wide glibc setting
    # Steps whose rows are all canvases being denoised run as one static step compiled with
    # torch.compile(fullgraph=True) (worker/canvas_step.py); None: ops/kernels.COMPILE_BY_DEFAULT of the device.
    compile: bool | None = flag(None, "run steps of canvases only as one static step compiled with torch.compile "
                                      "(default: off; on CUDA the static steps are CUDA graphs without compile, "
                                      "until a device measures what compiling buys)")
    # On CUDA the static steps are replayed as CUDA graphs, one per shape, unless this is set (and
    # then they are compiled only when compile=True), as vLLM's --enforce-eager.
    enforce_eager: bool = flag(False, "CUDA: no CUDA graphs for the static denoising steps (and no compile unless "
                                      "--compile)")
    # Denoising steps run back to back on the device per engine step while every row is a canvas
    # (worker/canvas_step.py): the host plans and reads results once per K steps; outputs are the
    # same for every K. vLLM's name for multi-step scheduling. None: STEPS_PER_LAUNCH of the device.
    num_scheduler_steps: int | None = flag(None, "denoising steps run back to back per engine step while every "
                                                 "request is denoising (default: the device's; outputs are the "
                                                 "same for any value)", minimum=1)
    # The engine starts step n+1 as soon as step n's results are applied, and makes step n's outputs
    # while n+1 runs (its caller streams them, adds and aborts requests meanwhile): vLLM's async
    # scheduling. Outputs are the same either way; a request added while a step runs starts one step
    # later. None: ASYNC_SCHEDULING of the device.
    async_scheduling: bool | None = flag(None, "start each engine step as soon as the previous one's results are "
                                               "applied, and make and stream that step's outputs while the next one "
                                               "runs (default: on for CUDA, off on the CPU)")
    num_threads: int | None = None  # tensor-parallel workers' intra-op threads; None: from their environment
    # seconds a tensor-parallel worker may stay silent before it counts as lost
    worker_timeout: float = flag(60.0, "seconds a tensor-parallel worker may not answer before it counts as lost and "
                                       "the workers restart", parse="seconds")
    # GB the sampler's temporaries may take beside the logits (tiles of positions, identical results);
    # None: an eighth of the device's free memory when the worker starts, at most 1 GiB.
    sampler_memory_gb: float | None = flag(None, "GB the sampler may use beside the logits; it tiles over positions "
                                                 "to stay within it (default: an eighth of the free device memory, at "
                                                 "most 1 GiB)", parse="positive")
    logprobs_mode: str = flag(LOGPROBS_MODES[0], "what generated tokens' logprobs report (vLLM's): raw_logprobs, the "
                                                 "model's log-softmax before temperature; raw_logits, its logits; "
                                                 "processed_logprobs / processed_logits, those of the temperature-"
                                                 "scaled distribution the sampler drew from", choices=LOGPROBS_MODES)
    # "auto": the checkpoint's safetensors; "dummy": random weights from config.json
    load_format: str = flag("auto", "auto: the checkpoint's weights; dummy: random weights built from config.json "
                                    "alone", choices=LOAD_FORMATS)
    num_layers_override: int | None = flag(None, "keep only the first N decoder layers (runs at real widths in less "
                                                 "memory)", minimum=1)
    # The sampler that denoises the canvases (blockdiff/diffusion/registry.py); None: the
    # architecture's own (model/registry.py), for DiffusionGemma the entropy-bound sampler.
    diffusion_sampler: str | None = flag(None, "the sampler that denoises canvases, by name: one of {samplers} (default: "
                                               "the architecture's own)", parse="sampler")
    # Tokens denoised together (vLLM's --diffusion-config canvas_length); None: the checkpoint's
    # config.json. The model runs any length; it was trained at its own.
    canvas_length: int | None = flag(None, "tokens denoised together in one canvas (default: the checkpoint's "
                                           "canvas_length)", minimum=1)
    # Where the sampler defaults come from, vLLM's --generation-config: "auto", the checkpoint's
    # generation_config.json; "vllm", none of it (the sampler's reference defaults); or a directory
    # holding a generation_config.json. The EOS ids are the checkpoint's whatever this says.
    generation_config: str = flag("auto", "the sampler defaults: auto (the checkpoint's generation_config.json), vllm "
                                          "(none: the sampler's reference defaults) or a directory holding a "
                                          "generation_config.json", metavar="auto|vllm|DIR")
    # Sampler defaults over the checkpoint's generation_config.json (the server's sampler flags),
    # as fields of the sampler's table.
    sampling_defaults: dict = field(default_factory=dict)
    # Inputs one prompt may hold per modality, vLLM's --limit-mm-per-prompt '{"image": N, "video": M}':
    # the flag sets the two fields below (__post_init__); 0 takes none.
    limit_mm_per_prompt: dict | None = flag(None, 'images and videos one prompt may hold, as JSON: \'{"image": N, '
                                                  '"video": M}\' (default 4 images, 1 video)',
                                            parse="mm_limits", group=_IMAGES)
    limit_images_per_prompt: int = 4
    limit_videos_per_prompt: int = 1
    max_image_bytes: int = flag(20 * 1024 * 1024, "largest encoded image in bytes, e.g. 8MiB", parse="size",
                                group=_IMAGES)  # an encoded image, before decoding
    # width x height of a decoded image (~120 MB of RGB)
    max_image_pixels: int = flag(40_000_000, "largest width x height of an image", minimum=1, group=_IMAGES)
    # its pixels decoded, 4 bytes each, checked from the image's header before decoding
    max_image_decoded_bytes: int = flag(64 * 1024 * 1024, "largest image decoded, at 4 bytes a pixel, checked from its "
                                                          "header before decoding, e.g. 64MiB", parse="size",
                                        group=_IMAGES)
    # Image URLs besides data: URLs (vLLM's names): http(s) hosts that may be fetched, and the
    # directory whose files file:// URLs may name. Both off by default.
    max_video_bytes: int = flag(64 * 1024 * 1024, "largest encoded video in bytes, e.g. 64MiB", parse="size",
                                group=_IMAGES)
    # frames x width x height of a video, from its header before decoding: every frame up to the last
    # one sampled is decoded, so this bounds the decoding work (1,000 frames of 1080p; 4K is 8.3 G)
    max_video_pixels: int = flag(2**31, "largest frames x width x height of a video, checked from its header "
                                        "before decoding", minimum=1, group=_IMAGES)
    # The sampled frames decoded, 3 bytes a pixel, from the header before decoding
    max_video_decoded_bytes: int = flag(256 * 1024 * 1024, "largest video's sampled frames decoded, at 3 bytes a pixel, "
                                                           "checked from its header before decoding, e.g. 256MiB",
                                        parse="size", group=_IMAGES)
    enable_lora: bool = flag(False, "serve LoRA adapters in PEFT's format per request (docs/lora.md)", group=_LORA)
    lora_modules: tuple[str, ...] = flag((), "adapters served from startup: name=path, or vLLM's JSON "
                                             '{"name": ..., "path": ..., "base_model_name": ...}', metavar="LORA",
                                         group=_LORA)
    max_loras: int = flag(1, "LoRA adapters one step can run (the device's adapter slots)", minimum=1, group=_LORA)
    max_lora_rank: int = flag(16, "largest LoRA rank served (each slot is sized for it)", minimum=1, group=_LORA)
    max_cpu_loras: int | None = flag(None, "LoRA adapters kept read in host memory (default: --max-loras)", minimum=1,
                                     group=_LORA)
    # The server's runtime loading (POST /v1/load_lora_adapter)
    lora_modules_dir: str | None = flag(None, "with --enable-lora: POST /v1/load_lora_adapter may load adapter "
                                              "directories under DIR (and only there); without it runtime loading is "
                                              "off", metavar="DIR", group=_LORA)
    max_runtime_loras: int = flag(64, "LoRA adapters loaded at runtime at once; more are refused until one is "
                                      "unloaded (each is listed in /v1/models)", minimum=1, group=_LORA)
    allowed_media_domains: tuple[str, ...] = flag(
        (), "hosts whose http(s) image URLs may be fetched (default: none; data: URLs always work)", metavar="DOMAIN",
        group=_IMAGES)
    allowed_local_media_path: str | None = flag(None, "directory whose files file:// image URLs may name (default: "
                                                      "none)", metavar="DIR", group=_IMAGES)
    media_fetch_timeout: float = flag(10.0, "seconds fetching an image URL may take in all", parse="seconds",
                                      group=_IMAGES)
    # A new structured-output constraint's token automaton is built in a child process stopped at this
    # bound (blockdiff/structured/compiler.py); the request is refused then.
    structured_outputs_timeout: float = flag(60.0, "seconds the automaton of a new JSON schema, regex or choice may take "
                                                   "to build before the request is refused", parse="seconds")
    # Each build's address space (RLIMIT_AS): 2 GiB is 7x what the 20-field schema of
    # benchmarks/structured_outputs.py takes at 262,144 tokens (docs/structured_outputs.md, "Bounds").
    structured_outputs_memory: int = flag(2 * 2**30, "address space one structured-output build may use before the "
                                                     "request is refused, e.g. 2GiB", parse="size")
    structured_outputs_builds: int = flag(2, "structured-output automata built at once (each a process on a core); "
                                             "waiting builds are started round robin across clients")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_prefill_tokens", "tensor_parallel_size", "max_model_len",
                     "max_denoising_steps_limit", "preempt_after_canvases", "max_image_bytes", "max_image_pixels",
                     "max_image_decoded_bytes", "max_video_bytes", "max_video_pixels", "max_video_decoded_bytes",
                     "structured_outputs_memory", "structured_outputs_builds",
                     "num_layers_override", "canvas_length", "num_scheduler_steps"):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "max_denoising_steps_limit", "preempt_after_canvases",
                                          "num_layers_override", "canvas_length", "num_scheduler_steps"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.data_parallel_size, int) or isinstance(self.data_parallel_size, bool) or self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {self.data_parallel_size!r}")
        rank = self.data_parallel_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.data_parallel_size):
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size={self.data_parallel_size}), got {rank!r}")
        if self.kv_events_config is not None:
            self.kv_events_config = KVEventsConfig.of(self.kv_events_config)
        if self.limit_mm_per_prompt is not None:
            limits = self.limit_mm_per_prompt
            if not isinstance(limits, dict) or set(limits) - {"image", "video"}:
                raise ValueError(f'limit_mm_per_prompt takes "image" and "video", got {limits!r}')
            self.limit_images_per_prompt = limits.get("image", self.limit_images_per_prompt)
            self.limit_videos_per_prompt = limits.get("video", self.limit_videos_per_prompt)
        for name in ("limit_images_per_prompt", "limit_videos_per_prompt"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {n!r}")
        if not (self.compile is None or isinstance(self.compile, bool)):
            raise ValueError(f"compile must be True, False or None (the device's default), got {self.compile!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        gb = self.sampler_memory_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 < gb < float("inf")):
            raise ValueError(f"sampler_memory_gb must be a positive number, got {gb!r}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise ValueError(f"generation_config must be auto, vllm or a directory holding a generation_config.json, "
                             f"got {self.generation_config!r}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix_cache_scope must be one of {PREFIX_CACHE_SCOPES}, got {self.prefix_cache_scope!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.lora_modules_dir is not None and not self.enable_lora:
            raise ValueError("--lora-modules-dir needs --enable-lora")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, got {self.kv_cache_dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.num_layers_override is not None and self.load_format != "dummy":
            raise ValueError("num_layers_override needs load_format='dummy' (a checkpoint holds every layer's weights)")

    def adapter_pool(self) -> AdapterPool | None:
        """Each rank's pool of LoRA adapters (--enable-lora), or None."""
        if not self.enable_lora:
            return None
        return AdapterPool(self.max_loras, self.max_lora_rank, self.max_cpu_loras or self.max_loras)

    def step_modes(self, device: str) -> tuple[bool | None, bool]:
        """(compile, cuda_graphs) on `device`; compile None: the device's default, where the model
        can run static steps."""
        cuda_graphs = torch.device(device).type == "cuda" and not self.enforce_eager
        return (bool(self.compile) if self.enforce_eager else self.compile), cuda_graphs

    def overlaps_steps(self, device: str) -> bool:
        """Whether the engine on `device` schedules asynchronously."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return ASYNC_SCHEDULING.get(torch.device(device).type, False)

    def steps_per_launch(self, device: str) -> int:
        """Denoising steps a steady-state step runs back to back on `device`."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        return STEPS_PER_LAUNCH.get(torch.device(device).type, 1)

    def check_model(self) -> None:
        """The model is a checkpoint directory, or with dummy weights a config.json file alone."""
        if not (os.path.isdir(self.model) or (self.load_format == "dummy" and os.path.isfile(self.model))):
            raise ValueError(f"model {self.model!r} is not a checkpoint directory (nor, with load_format='dummy', "
                             "a config.json file)")

    @property
    def replica(self) -> int:
        """This engine's data-parallel rank (0 when there is one engine)."""
        return self.data_parallel_rank or 0

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device
