"""A prompt and its SamplingParams become an EngineRequest at the edge (`request`: tokenized,
images and videos expanded, defaults merged once), and an EngineRequest becomes a validated Request
in the engine (`process`: bounds checked against this engine, seeded). Nothing invalid reaches the
scheduler."""

from __future__ import annotations

import functools
import random

from blockdiff.diffusion.strategy import DiffusionSampler
from blockdiff.engine.detokenizer import IncrementalDetokenizer
from blockdiff.engine.multimodal import MultiModalIntake, split_prompt
from blockdiff.engine.request import Request
from blockdiff.inputs import Adapter, EngineRequest, PromptInputs
from blockdiff.sampling_params import InvalidParam, ResolvedParams, SamplingParams
from blockdiff.structured.compiler import OutputConstraint, StructuredOutputs, check_ends, tokens_needed
from blockdiff.structured.lengths import check_room
from blockdiff.structured.restrictions import VocabularyRules
from blockdiff.structured.vocabulary import longest_token
from blockdiff.tokenizer import Tokenizer


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, sampler: DiffusionSampler, defaults: dict,
                 eos_token_ids: tuple[int, ...], vocab_size: int, canvas_length: int, max_model_len: int,
                 max_steps: int, cache_tokens: int, seed: int, mm: MultiModalIntake | None = None,
                 structured: StructuredOutputs | None = None):
        """defaults: the values of the sampler's fields that a request leaves unset (server flags over
        generation_config.json over the table's defaults). structured: the automata of structured
        outputs (None: the checkpoint has no tokenizer, so no text to constrain)."""
        self.tokenizer = tokenizer
        self.structured = structured
        self.rules = VocabularyRules(tokenizer, vocab_size)  # allowed_token_ids and bad_words
        self.sampler = sampler
        self.mm = mm  # the images and videos a prompt may hold
        self.defaults = defaults
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.canvas_length = canvas_length
        self.max_model_len = max_model_len
        self.max_steps = max_steps  # the engine's limit on max_denoising_steps
        self.cache_tokens = cache_tokens  # what the whole KV cache holds
        # Seeds of requests that bring none: reproducible from the engine seed, in arrival order.
        self._seeds = random.Random(seed)
        mine = {f.name for f in sampler.fields}
        foreign = sorted(k for k in defaults if k not in mine and k != "eos_token_ids")
        if foreign:
            raise ValueError(f"--{foreign[0].replace('_', '-')} is not a flag of this model's sampler, {sampler.name}, "
                             f"which takes {', '.join(sorted(mine))}")
        try:
            self.resolve(SamplingParams(), 1)
        except ValueError as e:
            raise ValueError(f"invalid sampler flags (over the checkpoint's generation_config.json): {e}") from None

    def request(self, prompt: str | list[int] | dict | PromptInputs, params: SamplingParams | None = None,
                adapter: Adapter | None = None, client: str | None = None) -> EngineRequest:
        """The engine request of a prompt as vLLM takes it (text, token ids, or {"prompt" /
        "prompt_token_ids", "multi_modal_data": {"image": ..., "video": ...}} with PIL images, encoded
        bytes or file paths, one per placeholder; or PromptInputs, expanded already) and the user's
        `params`: tokenized, its images and videos loaded and their placeholders expanded, its
        parameters resolved for its length."""
        if isinstance(prompt, PromptInputs):
            text, inputs = None, prompt
        else:
            text, inputs = self._prompt(*split_prompt(prompt))
        return EngineRequest(inputs, self.resolve(params, len(inputs.token_ids)), text, adapter, client)

    def process(self, request_id: str, request: EngineRequest) -> Request:
        """`request`, made at the edge, checked against this engine, seeded, and its Request built;
        its parameters are taken as they were resolved."""
        prompt, params = request.prompt, request.params
        ids = list(prompt.token_ids)
        if not ids:
            raise InvalidParam("prompt", "prompt is empty")
        if prompt.items:
            if self.mm is None:
                raise ValueError("this engine takes no images or videos")
            counts: dict[str, int] = {}
            for item in prompt.items:
                counts[item.modality] = counts.get(item.modality, 0) + 1
            self.mm.check_counts(counts)
        if len(ids) >= self.max_model_len:
            raise InvalidParam("prompt", f"prompt of {len(ids)} tokens leaves no room for output in "
                                         f"max_model_len={self.max_model_len}")
        if (params.prompt_len, params.sampler) != (len(ids), self.sampler.name):
            raise ValueError(f"the parameters were resolved for a prompt of {params.prompt_len} tokens by the "
                             f"{params.sampler!r} sampler; this prompt has {len(ids)} and this engine runs "
                             f"{self.sampler.name!r}")
        need = len(ids) + params.max_tokens
        if need > self.max_model_len:  # before the per-token checks, which a huge list would make slow
            raise InvalidParam(
                "max_tokens", f"max_tokens ({params.max_tokens}) + prompt ({len(ids)} tokens) = {need} exceeds "
                f"max_model_len={self.max_model_len}: ask for at most {self.max_model_len - len(ids)}"
            )
        self._check_tokens("prompt", ids)
        for name in ("draft", "stop_token_ids", "allowed_token_ids", "logit_bias"):
            self._check_tokens(name, list(getattr(params, name) or []))
        if params.stop and self.tokenizer is None:
            raise InvalidParam("stop", f"stop strings {params.stop!r} need a tokenizer, and this checkpoint has none: "
                                       "use stop_token_ids")
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        if params.min_tokens > params.max_tokens:
            raise InvalidParam("min_tokens", f"min_tokens ({params.min_tokens}) must be at most max_tokens "
                                             f"({params.max_tokens})")
        if params.prompt_logprobs is not None and prompt.items:
            raise InvalidParam("prompt_logprobs",
                               f"prompt_logprobs: a prompt with {prompt.items[0].modality}s cannot be scored")
        output = IncrementalDetokenizer(self.tokenizer, params.max_tokens, stops, params.stop, params.logprobs is not None,
                                        params.skip_special_tokens, params.min_tokens, params.include_stop_str_in_output)
        constraint = self._constraint(params, stops)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(64)
        req = Request(request_id, request.text, ids, params, self.canvas_length, seed, output, adapter=request.adapter,
                      placeholders=list(prompt.placeholders), client=request.client, constraint=constraint)
        if req.max_cached_tokens > self.cache_tokens:
            raise ValueError(f"request needs {req.max_cached_tokens} cached tokens, more than the whole KV cache "
                             f"({self.cache_tokens})")
        return req

    def _prompt(self, prompt: str | list[int], media: dict[str, list] | None) -> tuple[str | None, PromptInputs]:
        """-> (the prompt's text, if it came as text; its tokens and media, placeholders expanded)."""
        media = {m: s for m, s in (media or {}).items() if s}
        if media and self.mm is None:
            raise ValueError("this engine takes no images or videos")
        if self.mm is not None:
            self.mm.check_counts({m: len(s) for m, s in media.items()})
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass the prompt as a list of token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
        else:
            raise InvalidParam("prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if self.mm is None:
            return text, PromptInputs(ids)
        items = self.mm.load(media)
        # a text prompt is expanded as text (a video's timestamps tokenize with the text around them)
        if text is not None and items:
            return text, self.mm.expand_text(text, items, self.tokenizer.encode)
        return text, self.mm.expand(ids, items)

    def _constraint(self, params: SamplingParams, stops: set[int]) -> OutputConstraint | None:
        """What the request's committed output must be (its automaton built now unless cached): its
        structured output, its vocabulary restrictions (allowed_token_ids, bad_words), or both; None
        when it has none of them."""
        restricts = params.allowed_token_ids is not None or bool(params.bad_words)
        if params.structured_outputs is None:
            if not restricts:
                return None
            automaton, ends = self.rules.automaton(params.allowed_token_ids, params.bad_words, stops)
            # Every state goes on, so min_tokens can hold here: no end token before it, as vLLM.
            return OutputConstraint(automaton, ends, params.min_tokens, params.max_tokens)
        if self.structured is None:
            raise InvalidParam("structured_outputs", "structured outputs need the checkpoint's tokenizer, and this "
                                                     "checkpoint has none")
        automaton = self.structured.automaton(params.structured_outputs)
        ends = check_ends(automaton, stops)
        if restricts:
            automaton, ends = self.rules.structured(automaton, params.allowed_token_ids, params.bad_words, ends)
        need = tokens_needed(automaton)
        if need > params.max_tokens:
            raise InvalidParam("max_tokens", f"max_tokens ({params.max_tokens}) is too small for the structured output, "
                                             f"whose shortest text takes {need} tokens")
        return OutputConstraint(automaton, ends)

    def resolve(self, params: SamplingParams | None, prompt_len: int) -> ResolvedParams:
        """`params` with every default filled in, for a prompt of `prompt_len` tokens: the one place
        a request's parameters are resolved."""
        params = params or SamplingParams()
        if (params.n or 1) > 1:
            raise InvalidParam("n", f"n={params.n}: an engine request is one completion; LLM.generate and the server "
                                    f"run one request per choice")
        defaults = self.defaults
        if params.max_tokens is None:  # as much as fits, up to the server's --max-tokens if it set one
            room = max(1, self.max_model_len - prompt_len)
            given = defaults["max_tokens"]
            defaults = {**defaults, "max_tokens": room if given is None else max(1, min(given, room))}
        sampled = self.sampler.resolve(params, defaults, self.max_steps)
        resolved = ResolvedParams.of(sampled, prompt_len, self.sampler.name, self.sampler.canvas_values(sampled),
                                     self.sampler.request_options(sampled))
        if resolved.structured_outputs is not None and self.tokenizer is not None:
            # Before any build: a constraint no output within max_tokens meets would hold a build worker for nothing.
            check_room(resolved.structured_outputs, resolved.max_tokens, self._token_chars)
        return resolved

    @functools.cached_property
    def _token_chars(self) -> int:
        """The most characters one token spells (worked out at the first structured output)."""
        return longest_token(self.tokenizer)

    def cost(self, params: ResolvedParams) -> int:
        """Positions the decoder evaluates for a request at most: its canvases' steps, and with
        prompt_logprobs each prompt position once more (scored as a canvas, piece by piece)."""
        canvases = -(-params.max_tokens // self.canvas_length)
        scoring = params.prompt_len if params.prompt_logprobs is not None else 0
        return canvases * self.canvas_length * params.max_denoising_steps + scoring

    def _check_tokens(self, name: str, ids: list) -> None:
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParam(name, f"{name} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:8]}")
