"""The edge's `RequestBuilder`: an API request into engine requests, shared by the generation
endpoints (completions, chat, responses, messages) and /tokenize: its prompts tokenized, or its chat
rendered by the chat template; its images loaded and their placeholders expanded; its structured
output or forced tool calls compiled into a constraint; its sampling parameters built, resolved once
per prompt and priced; its adapter and client named. The result, EngineRequests (blockdiff/inputs.py),
the engine takes as they are. The CPU work runs in the server's preprocessing pool (work_pool.py),
images in theirs (media.py)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import fields, replace

from blockdiff.chat_parts import PART_MODALITY, template_content
from blockdiff.diffusion.registry import SAMPLERS
from blockdiff.engine.client import EngineClient
from blockdiff.entrypoints.openai import limits, protocol as p, vllm_fields
from blockdiff.entrypoints.openai.body import MAX_JSON_VALUES, Budget, decode_json
from blockdiff.entrypoints.openai.chat_output import OutputRules
from blockdiff.entrypoints.openai.errors import APIError, bad_value
from blockdiff.entrypoints.openai.media import ChatMedia
from blockdiff.entrypoints.openai.response_size import ENVELOPE, TOKEN_ID_TEXT, Pricing, chat_size
from blockdiff.entrypoints.openai.structured import constraint_field, request_constraint, tool_call_constraint
from blockdiff.entrypoints.openai.work_pool import WorkPool, check_deadline
from blockdiff.inputs import EngineRequest, PromptInputs
from blockdiff.multimodal import MediaError
from blockdiff.sampling_params import ResolvedParams, SamplingParams

MAX_N = 128  # choices per prompt (OpenAI's limit)
REQUEST_FIELDS = set(p.CompletionRequest.model_fields) | set(p.ChatCompletionRequest.model_fields) | {
    f.name for f in fields(SamplingParams)
} | {f.name for sampler in SAMPLERS.values() for f in sampler.fields}


def request_names(req: p._GenerationRequest) -> dict[str, str]:
    """The request fields that engine errors about `prompt`, `max_tokens` and `structured_outputs` are about."""
    field = constraint_field(req)
    if field is None and isinstance(req, p.ChatCompletionRequest) and req.tool_choice not in (None, "none", "auto"):
        field = "tool_choice"
    names = {} if field is None else {"structured_outputs": field}
    if not isinstance(req, p.ChatCompletionRequest):
        return names
    names["prompt"] = "messages"
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


def check_choices(prompts: int, n: int) -> None:
    if prompts * n > p.MAX_CHOICES:
        raise APIError(400, f"{prompts} prompts x n={n} = {prompts * n} choices, more than the {p.MAX_CHOICES} one "
                            "request may ask for", param="prompt" if n == 1 else "n")


def _decode_arguments(messages: list[dict]) -> None:
    """The arguments of earlier tool calls, JSON text as OpenAI clients send them, decoded in place
    into objects (vLLM decodes them too, so templates can format each argument): all of a request's
    within one budget of containers and nesting, their strings checked as the body's are."""
    budget = Budget(max_items=MAX_JSON_VALUES)  # no list of their own is too long: their text is bounded already
    for i, message in enumerate(messages):
        for k, call in enumerate(message.get("tool_calls", [])):
            what = f"messages[{i}].tool_calls[{k}].function.arguments"
            try:
                call["function"]["arguments"] = decode_json(call["function"]["arguments"], what, budget)
            except json.JSONDecodeError as e:
                raise APIError(400, f"{what} is not JSON: {e}", param="messages") from None
            except APIError as e:
                raise APIError(400, e.message, param="messages") from None


# Names the server gives the chat template itself; chat_template_kwargs may not set them.
_SERVER_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                        "eos_token", "unk_token"})


def generation_prompt(req: p.ChatCompletionRequest | p.TokenizeRequest) -> bool:
    """vLLM's add_generation_prompt: true unless the request continues its last message instead."""
    return not req.continue_final_message if req.add_generation_prompt is None else req.add_generation_prompt


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias, keyed by token ids as JSON strings, keyed by the ids."""
    out = {}
    for key, value in bias.items():
        if not key.strip().lstrip("-").isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r:.40}", param="logit_bias")
        out[int(key)] = value
    return out


def check_common(req: p._GenerationRequest) -> int:
    """Reject what the diffusion sampler cannot honour; -> n."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {n}", param="n")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options needs stream: true", param="stream_options")
    if req.stream_drafts and not req.stream:
        raise APIError(400, "stream_drafts needs stream: true", param="stream_drafts")
    if req.use_beam_search:
        raise APIError(400, "use_beam_search is not supported: a diffusion canvas is denoised whole, with no beams",
                       param="use_beam_search")
    if req.priority not in (None, 0):
        raise APIError(400, f"priority {req.priority}: this server serves requests first come, first served (only "
                            "priority 0)", param="priority")
    if req.truncate_prompt_tokens is not None and (isinstance(req.truncate_prompt_tokens, bool) or
                                                   not (req.truncate_prompt_tokens == -1 or req.truncate_prompt_tokens >= 1)):
        raise APIError(400, f"truncate_prompt_tokens must be -1 (the context's length) or >= 1, got "
                            f"{req.truncate_prompt_tokens}", param="truncate_prompt_tokens")
    return n


class RequestBuilder:
    """API requests -> engine requests (EngineRequest), for every endpoint of one server: the one
    place where a request's prompt, constraint and parameters are built."""

    def __init__(self, engine: EngineClient, pool: WorkPool, media: ChatMedia, max_request_cost: int | None,
                 max_response_bytes: int, default_chat_template_kwargs: dict | None = None,
                 trust_request_chat_template: bool = False):
        """default_chat_template_kwargs: vLLM's --default-chat-template-kwargs, under each request's own.
        trust_request_chat_template: whether a request's own chat template is rendered (vLLM's flag)."""
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template
        self.adapters: dict = {}  # the adapters served, by the model name a request gives (the server shares one dict)
        self.max_response_bytes = max_response_bytes
        # The CPU work of a request (tokenizer, chat template, their checks) runs in `pool`
        # (work_pool.py), its images and videos in `media` (media.py).
        self.pool = pool
        self.media = media
        self.limits = engine.limits
        self.tokenizer = engine.tokenizer
        self.sampler_extensions = p.sampler_extensions(engine.sampler.fields)  # what the bodies add
        # By default, one API request may ask for a full batch of the largest requests this server allows.
        largest = SamplingParams(max_tokens=self.limits.max_model_len, max_denoising_steps=self.limits.max_denoising_steps)
        self.max_request_cost = max_request_cost or self.limits.max_num_seqs * engine.cost(largest)
        # Longer text cannot fit in the context, whatever it encodes to; it is refused before the
        # tokenizer (which holds the GIL, stalling every other request) sees it.
        self.max_prompt_chars = None if self.tokenizer is None else self.limits.max_model_len * self.tokenizer.max_token_chars
        # What a token's text takes in a response, for its size estimate (response_size.py)
        self.token_bytes = TOKEN_ID_TEXT if self.tokenizer is None else self.tokenizer.mean_token_bytes
        self.default_template_kwargs = {}
        if default_chat_template_kwargs:
            if self.tokenizer is None:
                raise ValueError("--default-chat-template-kwargs: this checkpoint has no tokenizer, so no chat template")
            try:
                self.default_template_kwargs = self._template_kwargs(default_chat_template_kwargs)
            except APIError as e:
                raise ValueError(f"--default-chat-template-kwargs: {e.message}") from None

    # ---- prompts ------------------------------------------------------------------------------
    def encode(self, text: str, request_id: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this checkpoint has no tokenizer: send the prompt as token ids", param="prompt")
        if not text:  # as an empty list of ids: the BOS token alone is no prompt
            raise APIError(400, "prompt is empty", param="prompt")
        self.check_chars(len(text), "prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        self.tokenizer.warn_unknown(f"request {request_id}", text, ids)
        return ids

    def check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise APIError(400, f"{param} of {chars} characters cannot fit in max_model_len={self.limits.max_model_len} "
                                f"tokens (no token covers more than {self.tokenizer.max_token_chars} characters)",
                           param=param)

    def completion_prompts(self, prompt: str | list, request_id: str, add_special_tokens: bool = True) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode(prompt, request_id, add_special_tokens)]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        out = []
        for x in prompt:
            check_deadline()
            out.append(self.encode(x, request_id, add_special_tokens) if isinstance(x, str) else x)
        return out

    def truncated(self, prompts: list[list[int]], keep: int | None) -> list[list[int]]:
        """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: as many as the context holds)."""
        if keep is None:
            return prompts
        keep = self.limits.max_model_len if keep == -1 else keep
        return [ids[-keep:] for ids in prompts]

    def prompt_text(self, prompt: str | list[int], ids: list[int]) -> str:
        """What echo returns of a prompt: its text, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- chats -------------------------------------------------------------------------------
    def render_chat(self, messages: list[p.ChatMessage], request_id: str, add_generation_prompt: bool = True,
                    tools: list[p.Tool] | None = None, chat_template_kwargs: dict | None = None,
                    continue_final_message: bool = False, documents: list[dict] | None = None,
                    template: str | None = None, add_special_tokens: bool = False,
                    items: list | None = None) -> list[int] | PromptInputs:
        """The conversation's prompt ids. add_special_tokens: a BOS before what the template writes
        (vLLM's field; the template writes its own). items: its images and videos (chat_images),
        whose placeholders are expanded in the rendered text, as transformers' processor does."""
        if self.tokenizer is None:
            raise APIError(400, "this checkpoint has no tokenizer, so it has no chat template", param="messages")
        rendered = [self._template_message(i, m) for i, m in enumerate(messages)]
        kwargs = {**self.default_template_kwargs, **self._template_kwargs(chat_template_kwargs or {})}
        tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        # Everything the template reads counts, before it, the arguments' decoding or the tokenizer run.
        limits.check_template_text(rendered, tools, kwargs, self.max_prompt_chars, self.limits.max_model_len,
                                   self.tokenizer.max_token_chars)
        _decode_arguments(rendered)
        tok = self.tokenizer
        bos = add_special_tokens and tok.add_bos
        try:
            text = tok.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tools=tools,
                                           guard=check_deadline, max_chars=self.max_prompt_chars,
                                           continue_final_message=continue_final_message, documents=documents,
                                           template=template, **kwargs)
            if items:
                try:
                    return self.engine.mm.expand_text(text, items, lambda t: tok.encode(t, add_special_tokens=bos))
                except MediaError as e:
                    raise APIError(400, str(e), param="messages", code=e.code) from None
            ids = tok.encode(text, add_special_tokens=False)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        contents = "".join(m["content"] for m in rendered if isinstance(m["content"], str))
        tok.warn_unknown(f"request {request_id}", contents, ids)
        if bos and ids[:1] != [tok.bos_token_id]:
            ids = [tok.bos_token_id, *ids]
        return ids

    def _template_message(self, i: int, m: p.ChatMessage) -> dict:
        """A message as the chat template reads it: content parts as `template_content` renders them
        (the arguments of its tool calls are still JSON text; `_decode_arguments` decodes them)."""
        message = m.model_dump(exclude_none=True)
        if isinstance(message.get("content"), list):
            try:
                message["content"] = template_content(i, message["content"])
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        message.setdefault("content", "")
        return message

    def _template_kwargs(self, kwargs: dict) -> dict:
        """chat_template_kwargs, each a variable the template reads and the server does not set."""
        reserved = sorted(_SERVER_TEMPLATE_VARIABLES & kwargs.keys())
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them",
                           param="chat_template_kwargs")
        unread = sorted(kwargs.keys() - self.tokenizer.template_variables)
        if unread:
            raise APIError(400, f"chat_template_kwargs: this model's chat template does not read {', '.join(unread)}"
                                f"; it reads {', '.join(sorted(self.tokenizer.template_variables - _SERVER_TEMPLATE_VARIABLES)) or 'nothing else'}",
                           param="chat_template_kwargs")
        return kwargs

    # ---- chat requests -------------------------------------------------------------------------
    def chat_requests(self, req: p.ChatCompletionRequest, client: str, images: list, n: int, max_tokens: int | None,
                      logprobs: int | None, rules: OutputRules, request_id: str, prompt_logprobs: int | None = None):
        """(In the pool) -> (the prompt ids usage counts, `client`'s engine requests)."""
        constraint = self.chat_constraint(req, rules)
        prompt, prompts = self.chat_prompt(req, images, request_id)
        # The parsers read the format's markers, which are special tokens (vLLM's parsers do the same).
        # The response holds the prompt's scores once (prompt_logprobs, never streamed): one choice scores it.
        return prompts, self.engine_requests(req, client, [prompt], prompts, n, max_tokens, logprobs, chat_size,
                                             skip_special_tokens=not rules.parses, prompt_logprobs=prompt_logprobs,
                                             structured_outputs=constraint, score_once=True)

    def chat_prompt(self, req: p.ChatCompletionRequest, images: list, request_id: str):
        """(In the pool) -> (the engine's prompt, images expanded; the prompt ids usage counts)."""
        kwargs = req.chat_template_kwargs
        if req.reasoning_effort is not None and self.tokenizer is not None:
            kwargs = vllm_fields.reasoning_kwargs(req.reasoning_effort, self.tokenizer.template_variables, kwargs or {})
        ids = self.render_chat(req.messages, request_id, tools=req.tools, chat_template_kwargs=kwargs,
                               add_generation_prompt=generation_prompt(req),
                               continue_final_message=bool(req.continue_final_message), documents=req.documents,
                               template=self.request_template(req), add_special_tokens=bool(req.add_special_tokens),
                               items=images)
        if req.truncate_prompt_tokens is not None:
            if images:
                raise APIError(400, "truncate_prompt_tokens: a chat with images or videos cannot be cut (their "
                                    "tokens come whole)", param="truncate_prompt_tokens")
            ids = self.truncated([ids], req.truncate_prompt_tokens)[0]
        return (ids, [ids.token_ids]) if images else (ids, [ids])

    def request_template(self, req: p.ChatCompletionRequest) -> str | None:
        """A request's own chat template, which only a server started to trust them renders (vLLM's rule)."""
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template: this server renders only its own chat template (start it with "
                                "--trust-request-chat-template to allow a request's)", param="chat_template")
        return req.chat_template

    @staticmethod
    def chat_constraint(req: p.ChatCompletionRequest, rules: OutputRules):
        """(In the pool) What the chat's output must be: its structured output, or with a forced
        tool_choice the calls, their arguments as the tools' parameter schemas say; None: anything."""
        constraint = request_constraint(req)
        if rules.forced:
            if constraint is not None:
                raise APIError(400, "a forced tool_choice and a structured output both constrain the output: give one",
                               param="tool_choice")
            constraint = tool_call_constraint(req.tools, rules.allowed, rules.parallel)
        return constraint

    # ---- images and videos in chat messages (docs/images.md, docs/video.md) ---------------------
    async def chat_images(self, messages: list[p.ChatMessage], client: str) -> list:
        """The items of the messages' image_url and video_url parts, fetched, decoded and
        preprocessed off the event loop (media.py); a bad one is a 400 naming it."""
        if not any(isinstance(m.content, list) and any(part.type in PART_MODALITY for part in m.content) for m in messages):
            return []
        return await self.media.load([m.model_dump(exclude_none=True) for m in messages], client)

    # ---- sampling parameters: resolved once, priced ----------------------------------------------
    def engine_requests(self, req: p._GenerationRequest, client: str, prompts: list[list[int] | PromptInputs],
                        lengths: list[list[int]], n: int, max_tokens: int | None, logprobs: int | None, size: Pricing,
                        skip_special_tokens: bool = True, prompt_logprobs: int | None = None, structured_outputs=None,
                        score_once: bool = False) -> list[EngineRequest]:
        """n engine requests per prompt, of `client`, with the adapter `req.model` names, checked
        against the limits first, their parameters resolved once per prompt (for its length) and
        taken by the engine as they are. The choices of a prompt share its ResolvedParams but their
        seeds (and so its draft and stop lists); prompt-major.
        size: how the endpoint's response spells what it returns (response_size.py).
        skip_special_tokens: the endpoint's default, under the request's own (vLLM's field).
        score_once: only a prompt's first choice scores it (prompt_logprobs), and the response gives
        its scores to every choice of the prompt: they are the same prompt's, whatever the seed
        (unless the choices generate nothing, max_tokens 0, and so are their scorings)."""
        limits.check_token_lists(n, [len(ids) for ids in lengths], req.draft, req.stop_token_ids, self.limits.max_model_len)
        names = (*p.SAMPLER_EXTENSIONS, *p.VLLM_SAMPLING, *self.sampler_extensions)
        values = {k: getattr(req, k) for k in names if getattr(req, k) is not None}
        if req.logit_bias is not None:
            values["logit_bias"] = logit_bias(req.logit_bias)
        skip = skip_special_tokens if req.skip_special_tokens is None else req.skip_special_tokens
        try:
            params = SamplingParams.of(**values, max_tokens=max_tokens, seed=req.seed, stop=req.stop, logprobs=logprobs,
                                       min_tokens=req.min_tokens or 0, prompt_logprobs=prompt_logprobs,
                                       output_kind="delta" if req.stream else "final_only", skip_special_tokens=skip,
                                       structured_outputs=structured_outputs)
            inputs = [prompt if isinstance(prompt, PromptInputs) else PromptInputs(prompt) for prompt in prompts]
            resolved = [self.engine.resolve(params, len(prompt.token_ids)) for prompt in inputs]
        except ValueError as e:
            raise bad_value(e, REQUEST_FIELDS, request_names(req)) from None
        # A choice of max_tokens 0 is its scoring, nothing else: each scores the prompt.
        choices = [[params if i == 0 else self._choice(params, i, not score_once or params.max_tokens == 0)
                    for i in range(n)] for params in resolved]
        self._check_cost(choices, size, req.return_tokens_as_token_ids)
        adapter = self.adapters.get(req.model) if req.model is not None else None
        return [EngineRequest(prompt, params, adapter=adapter, client=client, priority=req.priority or 0)
                for prompt, of_prompt in zip(inputs, choices) for params in of_prompt]

    @staticmethod
    def _choice(params: ResolvedParams, choice: int, scored: bool) -> ResolvedParams:
        """Choice i > 0 of a prompt: seeded s, it draws from s + i; unless `scored`, it does not score
        the prompt. A shallow copy shares the checked lists."""
        if params.seed is None and (scored or params.prompt_logprobs is None):
            return params
        out = copy.copy(params)
        if params.seed is not None:
            out.seed = params.seed + choice
        if not scored:
            out.prompt_logprobs = None
        return out

    def _check_cost(self, choices: list[list[ResolvedParams]], size: Pricing, tokens_as_ids: bool | None) -> None:
        """Refuse an API request that would hold the decoder longer than the limit allows, or answer
        more than --max-response-bytes. A prompt's choices differ in their seeds, and whether they score it."""
        # Lengths beyond the context are the engine's to refuse, with its own message.
        within = [[replace(c, max_tokens=min(c.max_tokens, max(1, self.limits.max_model_len - c.prompt_len)))
                   for c in of_prompt] for of_prompt in choices]
        cost = sum(self.engine.cost(c) for of_prompt in within for c in of_prompt)
        if cost > self.max_request_cost:
            raise APIError(400, f"this request asks for up to {cost} canvas positions of denoising (choices x canvases x "
                                f"max_denoising_steps x canvas length, and prompt positions scored), more than this "
                                f"server's limit of {self.max_request_cost} per request: lower n, max_tokens or "
                                "max_denoising_steps", param="max_tokens", code="request_too_costly")
        text = max(self.token_bytes, TOKEN_ID_TEXT if tokens_as_ids else 0)
        first = choices[0][0]
        # A prompt's choices return as much as its first (the one that scores it, if any), which the size prices.
        total = ENVELOPE + math.ceil(sum(size(of_prompt[0], len(of_prompt), text) for of_prompt in within))
        if total > self.max_response_bytes:
            raise APIError(400, f"this request's response could take about {total} bytes (choices x tokens returned, with "
                                f"their logprobs and alternatives, the prompt's too where they are returned), more than "
                                f"this server's limit of {self.max_response_bytes} (--max-response-bytes): lower n, "
                                "logprobs, prompt_logprobs or max_tokens, or leave out echo",
                           param="logprobs" if first.logprobs is not None or first.prompt_logprobs is not None
                           else "max_tokens", code="response_too_large")
