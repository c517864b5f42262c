"""Sampling parameters of one request: the sampler-field tables, validation, defaults.

A `SamplerField` describes one sampler field once: its type, reference default, bounds, help text
and generation_config.json key. Each sampler (blockdiff/diffusion/) has its table of them; the
OpenAI protocol's extra body fields, the command line's sampler flags and the sampler's per-canvas
step inputs are built from the table of the sampler a model runs. `SAMPLER_FIELDS` is the table of
the reference sampler (entropy-bound, DiffusionGemma's own), whose fields SamplingParams declares;
another sampler's fields travel in `SamplingParams.extra_args` (vLLM's field for the arguments of
other samplers; `SamplingParams.of` puts them there).

Bounds are those of the dtype a value is used in: per-canvas fields travel to the sampler as
int32 or float32 tensors, so an accepted value is always representable there, and temperatures
stay normal float32 numbers at every step of the schedule (no NaN from an accepted value).

Defaults are merged once, by the sampler's `resolve`: the request's value, else the server's flag,
else generation_config.json, else the reference default. A bad value raises `InvalidParam`, a
ValueError that names the field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# The lowest temperature any denoising step may divide by: logits over it stay far from the
# float32 range (and from the -1e30 that marks padded vocabulary rows), so nothing overflows.
MIN_TEMPERATURE = 1e-20
MAX_TEMPERATURE = 1e4
MAX_LOGPROBS = 20
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS = 128, 16384  # vLLM's 128 words (as token sequences); characters in all
MAX_LOGIT_BIAS, LOGIT_BIAS_BOUND = 300, 100.0  # OpenAI's: at most 300 tokens, each biased by a value in [-100, 100]
PENALTY_BOUND = 2.0  # vLLM's (and OpenAI's): presence_penalty and frequency_penalty in [-2, 2]


class InvalidParam(ValueError):
    """A request parameter that cannot be served: `field` names it (the API's `param`), the message
    says why and starts with the field's name."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplerField:
    name: str
    type: type  # int, float, or str (one of `choices`)
    default: int | float | None  # the reference implementation's; None: decided per request
    help: str
    minimum: float
    maximum: float
    exclusive_minimum: bool = False
    generation_config: str | None = None  # key in generation_config.json ("a.b": nested); None: not read
    per_canvas: bool = True  # sent to the sampler as a [canvases] tensor
    dtype: str = "float32"  # of that tensor
    steps: bool = False  # a number of denoising steps: at most the engine's steps limit
    # Values that change nothing: a model whose sampler lacks the field accepts it at these (clients
    # send vLLM's truncation knobs at their neutral values whatever the model).
    neutral: tuple = ()
    choices: tuple[str, ...] = ()  # a str field's values


# The denoising modes (docs/architecture.md, "Fewer forwards"): "exact" runs the reference's steps;
# "fast" settles positions whose argmax held, stops renoising them, runs only the unsettled rows and
# streams the settled prefix.
DENOISING_MODES = ("exact", "fast")

SAMPLER_FIELDS: tuple[SamplerField, ...] = (
    # Unset, a request may generate what fits in the context (engine/input_processor.py), as in vLLM:
    # generation_config.json's max_new_tokens is the reference generate()'s default, one canvas of
    # the released checkpoint, which would cut answers (thinking ones above all) short.
    # 0 only with prompt_logprobs: the prompt is scored and nothing is generated (SamplingParams checks).
    SamplerField("max_tokens", int, None, "tokens to generate at most", 0, INT32_MAX, per_canvas=False),
    SamplerField("max_denoising_steps", int, 48, "denoising steps per canvas at most", 1, INT32_MAX,
                 generation_config="max_denoising_steps", dtype="int32", steps=True),
    SamplerField("entropy_bound", float, 0.1, "accept tokens while Σentropy - max entropy stays below this",
                 0, FLOAT32_MAX, exclusive_minimum=True, generation_config="sampler_config.entropy_bound"),
    SamplerField("t_min", float, 0.4, "temperature at the last denoising step", 0, MAX_TEMPERATURE,
                 generation_config="t_min"),
    SamplerField("t_max", float, 0.8, "temperature at the first denoising step", 0, MAX_TEMPERATURE,
                 exclusive_minimum=True, generation_config="t_max"),
    SamplerField("stability_threshold", int, 1, "previous argmax canvases that must match to stop early", 0,
                 INT32_MAX, generation_config="stability_threshold", dtype="int32", steps=True),
    # 0: never stops on confidence, so every canvas runs max_denoising_steps steps (vLLM's benchmarks use
    # this). transformers refuses 0 and turns its stopping off with confidence_threshold=None instead.
    SamplerField("confidence_threshold", float, 0.005, "mean entropy under which a stable canvas stops (0: never: "
                 "every canvas runs max_denoising_steps steps)", 0, FLOAT32_MAX,
                 generation_config="confidence_threshold"),
    # vLLM's truncation knobs restrict the candidate draw only (docs/architecture.md, "Sampler"). The
    # reference sampler has none, so a checkpoint's generation_config.json values are not applied.
    SamplerField("top_k", int, -1, "draw candidates from the k most likely tokens only; -1 or 0: all", -1,
                 INT32_MAX, dtype="int32", neutral=(-1, 0)),
    SamplerField("top_p", float, 1.0, "draw candidates from the smallest set of most likely tokens holding this "
                 "much probability", 0, 1, exclusive_minimum=True, neutral=(1,)),
    SamplerField("min_p", float, 0.0, "draw candidates only among tokens at least this fraction as likely as "
                 "the most likely one", 0, 1, neutral=(0,)),
    SamplerField("denoising_mode", str, "exact", "exact: the reference's steps; fast: positions settle early, later "
                 "steps run only the unsettled ones and the settled prefix streams", 0, 0, per_canvas=False,
                 neutral=("exact",), choices=DENOISING_MODES),
    # The fast mode's rule; defaults from the held-out eval (docs/benchmarks.md, "The fast denoising mode").
    SamplerField("settle_steps", int, 1, "fast mode: steps a position's argmax must hold before it settles", 1,
                 INT32_MAX, dtype="int32", steps=True),
    SamplerField("settle_entropy", float, 0.3, "fast mode: entropy (nats) under which a held position settles", 0,
                 FLOAT32_MAX),
)
# The fields of every sampler's table: how much a request generates, how long a canvas may take.
ENGINE_FIELDS = SAMPLER_FIELDS[:2]
FIELDS_BY_NAME = {f.name: f for f in SAMPLER_FIELDS}
PER_CANVAS_FIELDS = tuple(f for f in SAMPLER_FIELDS if f.per_canvas)
REFERENCE_DEFAULTS = {f.name: f.default for f in SAMPLER_FIELDS}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must be (vLLM's StructuredOutputsParams): exactly one of a JSON
    schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular expression
    matched whole (`regex`), one of a list of strings (`choice`), or a context-free `grammar`
    (refused: a canvas is constrained by a finite automaton). docs/structured_outputs.md says what
    is guaranteed. `special_tokens`: special tokens a regex may spell, the k-th as the character
    chr(0xE000 + k) (the tool-call format's markers, blockdiff/structured/vocabulary.py)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None  # between JSON tokens; default: at most one space
    special_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidParam("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, "
                                                     f"grammar, json_object; got {', '.join(kinds) or 'none'}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise InvalidParam("structured_outputs", f"structured_outputs.{name} must be a non-empty string, got {v!r:.80}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidParam("structured_outputs", f"structured_outputs.json must be a JSON schema (an object or its "
                                                     f"JSON text), got {self.json!r:.80}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise InvalidParam("structured_outputs", "structured_outputs.choice must be a non-empty list of "
                                                         f"non-empty strings, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.special_tokens, tuple) or not all(isinstance(t, str) for t in self.special_tokens):
            raise InvalidParam("structured_outputs", "structured_outputs.special_tokens must be a tuple of token strings")

    def key(self) -> str:
        """The constraint as canonical text: equal for equal constraints (the automaton cache's key)."""
        return json.dumps({k: v for k, v in self.__dict__.items() if v not in (None, (), False)}, sort_keys=True)


@dataclass
class SamplingParams:
    """Sampling parameters of one request; the engine's sampler fills the unset fields of its table
    (`DiffusionSampler.resolve`). The first fields are those of `SAMPLER_FIELDS`, in the table's
    order (tests/engine/test_engine_core.py checks it); other samplers' fields go in `extra_args`."""

    max_tokens: int | None = None
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    denoising_mode: str | None = None
    settle_steps: int | None = None
    settle_entropy: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # No EOS, stop token or stop string ends the output before this many tokens (vLLM's): a canvas
    # that commits one of those tokens earlier takes its most likely other token there instead.
    min_tokens: int = 0
    draft: list[int] | None = None  # token ids the canvases start from, canvas after canvas
    logprobs: int | None = None  # top logprobs per token; 0 returns only the chosen token's logprob
    # Score the prompt (vLLM's prompt_logprobs): each prompt token after the first gets the denoiser's
    # log-probability with its piece of the prompt as the canvas (docs/architecture.md, "Scoring"),
    # and this many top alternatives; RequestOutput.prompt_logprobs holds them.
    prompt_logprobs: int | None = None
    stream_drafts: bool = False  # report the argmax canvas after every denoising step
    draft_details: bool = False  # with each draft, the step's entropy and accepted positions
    skip_special_tokens: bool = True  # leave special tokens out of the text (vLLM's option)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token's text) ends the text
    # vLLM's: the request's prefix-cache entries are keyed with this too, so only requests with the
    # same salt share cached K/V (and cached_tokens reveals nothing across salts).
    cache_salt: str | None = None
    output_kind: str = "cumulative"  # "cumulative", "delta" or "final_only" (see blockdiff.outputs)
    temperature: float | None = None  # scales the t_min .. t_max schedule; 0: greedy
    # Completions per prompt: LLM.generate and the server run each as a request of its own, choice
    # i drawing from seed + i (the engine itself takes one completion per request).
    n: int | None = None
    # vLLM's penalties and OpenAI's logit_bias, applied to every canvas position's logits at every
    # denoising step (worker/penalties.py): repetition_penalty (> 0, 1: none) scales the logits of
    # the tokens in the prompt or the committed output; frequency_penalty and presence_penalty (in
    # [-2, 2], 0: none) subtract per committed occurrence / once per token committed; logit_bias
    # adds to the logits of its token ids (at most 300, values in [-100, 100]).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    # The fields of samplers other than the reference one, by name (their tables check them when the
    # engine resolves the request).
    extra_args: dict[str, int | float] | None = None
    # What the output must be: a JSON schema, a regex, a choice (docs/structured_outputs.md).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's vocabulary restrictions (blockdiff/structured/restrictions.py): only these token ids may
    # be generated (end tokens too: an EOS not among them never ends the output); no generated text
    # holds one of these words' tokens (each word tokenized with and without a leading space).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @classmethod
    def of(cls, **values) -> "SamplingParams":
        """SamplingParams from fields of any sampler: the ones it declares as themselves, the others
        in extra_args."""
        extra = {k: values.pop(k) for k in [k for k in values if k not in _DECLARED]}
        given = values.pop("extra_args", None) or {}
        return cls(**values, extra_args={**given, **extra} or None)

    def __post_init__(self) -> None:
        for f in SAMPLER_FIELDS:
            check_field(f, getattr(self, f.name))
        if self.t_min is not None and self.t_max is not None and self.t_max < self.t_min:
            raise InvalidParam("t_max", f"t_max must be >= t_min, got t_max={self.t_max} < t_min={self.t_min}")
        if self.temperature is not None and not (_is_number(self.temperature) and 0 <= self.temperature < math.inf):
            raise InvalidParam("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict) or not all(isinstance(k, str) for k in self.extra_args):
                raise InvalidParam("extra_args", f"extra_args must be a dict of sampler fields, got {self.extra_args!r}")
            declared = sorted(set(self.extra_args) & _DECLARED)
            if declared:
                raise InvalidParam(declared[0], f"{declared[0]} is a SamplingParams field: set it directly, not in extra_args")
        self._check_penalties()
        _int(self, "n", minimum=1)
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= 1024):
            raise InvalidParam("cache_salt", "cache_salt must be a non-empty string of at most 1024 characters")
        _int(self, "seed", minimum=None)
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidParam("seed", f"seed must fit in 64 bits, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
                raise InvalidParam("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        _token_list(self, "stop_token_ids")
        _token_list(self, "draft")
        for name in ("ignore_eos", "stream_drafts", "draft_details", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParam(name, f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.draft_details and not self.stream_drafts:
            raise InvalidParam("draft_details", "draft_details needs stream_drafts: true")
        if self.output_kind not in OUTPUT_KINDS:
            raise InvalidParam("output_kind", f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParam("structured_outputs", "structured_outputs must be a StructuredOutputsParams, got "
                                                     f"{type(self.structured_outputs).__name__}")
        _token_list(self, "allowed_token_ids")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidParam("allowed_token_ids", "allowed_token_ids is empty: it would allow no token (leave it "
                                                    "unset to allow every token)")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                                        for w in self.bad_words):
                raise InvalidParam("bad_words", f"bad_words must be a list of non-blank strings, got {self.bad_words!r:.80}")
            self.bad_words = list(self.bad_words)
            # vLLM's bound is on their token sequences (checked once tokenized); this bounds the tokenizer's work.
            if len(self.bad_words) > MAX_BAD_WORDS or sum(map(len, self.bad_words)) > MAX_BAD_WORDS_CHARS:
                raise InvalidParam("bad_words", f"bad_words: at most {MAX_BAD_WORDS} words of {MAX_BAD_WORDS_CHARS} "
                                                f"characters in all, got {len(self.bad_words)} of "
                                                f"{sum(map(len, self.bad_words))}")
        for name in ("logprobs", "prompt_logprobs"):
            _int(self, name, minimum=0)
            if getattr(self, name) is not None and getattr(self, name) > MAX_LOGPROBS:
                raise InvalidParam(name, f"{name} must be at most {MAX_LOGPROBS}, got {getattr(self, name)}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidParam("max_tokens", "max_tokens must be >= 1 (0 only with prompt_logprobs, which scores the "
                                             "prompt and generates nothing)")
        _int(self, "min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                                             f"({self.max_tokens})")

    def _check_penalties(self) -> None:
        """vLLM's bounds on its penalties, OpenAI's on logit_bias (ids within the vocabulary are the
        engine's check, engine/input_processor.py)."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and not (_is_number(v) and -PENALTY_BOUND <= v <= PENALTY_BOUND):
                raise InvalidParam(name, f"{name} must be a number in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}], "
                                         f"got {v!r}")
        v = self.repetition_penalty
        if v is not None and not (_is_number(v) and 0 < v <= FLOAT32_MAX):
            raise InvalidParam("repetition_penalty", f"repetition_penalty must be a finite number > 0, got {v!r}")
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict) or not all(_is_int(k) and k >= 0 for k in self.logit_bias):
            raise InvalidParam("logit_bias", f"logit_bias must map token ids (integers >= 0) to numbers, got "
                                             f"{self.logit_bias!r:.80}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidParam("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for k, b in self.logit_bias.items():
            if not (_is_number(b) and -LOGIT_BIAS_BOUND <= b <= LOGIT_BIAS_BOUND):
                raise InvalidParam("logit_bias", f"logit_bias[{k}] must be a number in [-{LOGIT_BIAS_BOUND:g}, "
                                                 f"{LOGIT_BIAS_BOUND:g}], got {b!r}")
        self.logit_bias = dict(self.logit_bias)

    @property
    def penalized(self) -> bool:
        """Whether a penalty or a logit bias changes this request's logits."""
        return (self.repetition_penalty not in (None, 1) or self.presence_penalty not in (None, 0)
                or self.frequency_penalty not in (None, 0) or bool(self.logit_bias))


_DECLARED = {f.name for f in fields(SamplingParams)}


@dataclass
class ResolvedParams(SamplingParams):
    """SamplingParams as an engine resolved them (`EngineClient.resolve`): every field of its
    sampler's table set and every bound checked, for a prompt of `prompt_len` tokens. An engine
    given these takes them as they are, instead of resolving the request's parameters again."""

    prompt_len: int = 0
    sampler: str = ""  # the name of the sampler that resolved them
    # What the sampler's step reads of the request, as plain values that the engine carries to the
    # ranks untouched (DiffusionSampler.step_inputs): its per-canvas field values by name, and the
    # step options it raises (a step's option is set when any of its canvases raises it).
    per_canvas: dict[str, int | float] = field(default_factory=dict)
    options: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def of(cls, params: SamplingParams, prompt_len: int, sampler: str, per_canvas: dict[str, int | float],
           options: dict[str, bool]) -> "ResolvedParams":
        return cls(**{f.name: getattr(params, f.name) for f in fields(SamplingParams)}, prompt_len=prompt_len,
                   sampler=sampler, per_canvas=per_canvas, options=options)


def field_value(params: SamplingParams, name: str):
    """A sampler field's value in `params`: declared, or in extra_args; None when unset."""
    if name in _DECLARED:
        return getattr(params, name)
    return (params.extra_args or {}).get(name)


def with_field_values(params: SamplingParams, values: dict) -> SamplingParams:
    """`params` with sampler fields set to `values` (declared ones as themselves, others in extra_args)."""
    extra = {k: v for k, v in values.items() if k not in _DECLARED}
    return replace(params, **{k: v for k, v in values.items() if k in _DECLARED},
                   extra_args={**(params.extra_args or {}), **extra} or None)


def generation_defaults(model_dir: str | None, table: tuple[SamplerField, ...] = SAMPLER_FIELDS) -> dict:
    """The reference defaults of a sampler's fields (`table`) overridden by the checkpoint's
    generation_config.json (plus its EOS ids)."""
    out = {f.name: f.default for f in table}
    path = os.path.join(model_dir, "generation_config.json") if model_dir else None
    if not path or not os.path.isfile(path):
        return out
    with open(path) as fh:
        gen = json.load(fh)
    for f in (f for f in table if f.generation_config):
        value = gen
        for key in f.generation_config.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            check_field(f, value, where=f"{path}: ")
            out[f.name] = value
    if gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]
        out["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    return out


def within(f: SamplerField, v) -> bool:
    """Whether `v` is a value of field `f`: of its type, within its bounds (one of its choices)."""
    if f.choices:
        return v in f.choices
    if f.type is int:
        if not _is_int(v):
            return False
    elif not _is_number(v) or not math.isfinite(v):
        return False
    low_ok = v > f.minimum if f.exclusive_minimum else v >= f.minimum
    return low_ok and v <= f.maximum


def check_field(f: SamplerField, v, where: str = "") -> None:
    """InvalidParam unless `v` is None or a value of field `f`."""
    if v is None or within(f, v):
        return
    if f.choices:
        raise InvalidParam(f.name, f"{where}{f.name} must be one of {', '.join(map(repr, f.choices))}, got {v!r}")
    kind = "an integer" if f.type is int else "a finite number"
    low = ">" if f.exclusive_minimum else ">="
    raise InvalidParam(f.name, f"{where}{f.name} must be {kind} {low} {f.minimum:g} and <= {f.maximum:g}, got {v!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(p, name: str, minimum: int | None) -> None:
    v = getattr(p, name)
    if v is None:
        return
    if not _is_int(v) or (minimum is not None and v < minimum):
        bound = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise InvalidParam(name, f"{name} must be {bound}, got {v!r}")


def _token_list(p, name: str) -> None:
    v = getattr(p, name)
    if v is None:
        return
    if not isinstance(v, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in v):
        raise InvalidParam(name, f"{name} must be a list of non-negative token ids, got {v!r}")
    setattr(p, name, list(v))
