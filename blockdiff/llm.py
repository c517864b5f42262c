"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import partial

from blockdiff.config import EngineConfig
from blockdiff.chat_parts import MediaPolicy, fetch_url, split_chat_media
from blockdiff.engine.lora_request import LoRARequest
from blockdiff.engine.sync_client import SyncClient
from blockdiff.hub import resolve_model, resolve_tokenizer
from blockdiff.inputs import EngineRequest
from blockdiff.outputs import RequestOutput
from blockdiff.sampling_params import SamplingParams
from blockdiff.engine.startup import start_client, start_engine
from blockdiff.vllm_options import engine_keywords

# A prompt: text, token ids, or (vLLM's form) {"prompt": text or "prompt_token_ids": ids,
# "multi_modal_data": {"image": one image or a list, "video": one video or a list}} with PIL images,
# encoded bytes or file paths (a video also as decoded frames, a uint8 array [frames, H, W, 3]).
Prompt = str | list[int] | dict


class LLM:
    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        download_dir: str | None = None,
        **engine_options,
    ):
        """`model`: a checkpoint directory, a Hugging Face id in the local cache (`download_dir`,
        else HF_HUB_CACHE / HF_HOME), or None (or "demo") for the bundled demo checkpoint.
        engine_options: the other EngineConfig fields (max_num_seqs, max_model_len, ...,
        tune_cpu_heap=True to keep freed memory in the heap, see blockdiff/worker/cpu_heap.py), and
        vLLM's keywords as the command line takes its flags (blockdiff/vllm_options.py): those that
        mean nothing here are ignored with a warning (trust_remote_code, gpu_memory_utilization, ...),
        max_num_batched_tokens is max_prefill_tokens, diffusion_config and hf_overrides map onto the
        canvas length, the sampler and its defaults."""
        options = engine_keywords(engine_options)
        if options.get("tokenizer") is not None:
            options["tokenizer"] = resolve_tokenizer(options["tokenizer"], download_dir)
        cfg = EngineConfig(model=resolve_model(model, download_dir), tensor_parallel_size=tensor_parallel_size,
                           dtype=dtype, device=device, seed=seed, **options)
        # data_parallel_size=N: N engine processes behind a front end (engine/dp_client.py); `engine`
        # is then None and requests go through `replicas`.
        self.engine, self.replicas = None, None
        if cfg.data_parallel_size > 1 and cfg.data_parallel_rank is None:
            self.replicas = SyncClient(start_client(cfg))
            self.tokenizer, self._mm = self.replicas.client.tokenizer, self.replicas.client.mm
            self._inputs = self.replicas.client.inputs
        else:
            self.engine = start_engine(cfg)
            self.tokenizer, self._mm = self.engine.tokenizer, self.engine.inputs.mm
            self._inputs = self.engine.inputs  # makes each engine request, once, here at the edge
        self._media = MediaPolicy.of(cfg)  # where LLM.chat's image and video URLs may point

    @property
    def llm_engine(self):
        """The engine (vLLM's name for it): `LLMEngine`, blockdiff/engine/engine.py."""
        return self.engine

    def get_tokenizer(self):
        """The checkpoint's tokenizer (blockdiff/tokenizer.py: encode, decode, apply_chat_template), or
        None for a checkpoint without one."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request (with enable_lora=True): the LoRA adapter of every prompt, or one per prompt."""
        prompts = _as_prompt_list(prompts)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        # Only the final outputs are read: the engine builds nothing before them.
        choices = [(i, prompt, c) for i, (prompt, p) in enumerate(zip(prompts, params))
                   for c in _choices(replace(p or SamplingParams(), output_kind="final_only"))]
        made = [self._inputs.request(prompt, c, loras[i]) for i, prompt, c in choices]
        if self.replicas is not None:
            return _merged(self._run_replicas(made, use_tqdm), choices)
        requests, warned = [], set()
        try:
            for (i, prompt, _), request in zip(choices, made):
                requests.append(self.engine.add(request))
                if isinstance(prompt, str) and i not in warned:
                    warned.add(i)
                    self.tokenizer.warn_unknown(f"request {requests[-1].request_id}", prompt, requests[-1].prompt_token_ids)
        except Exception:
            for req in requests:
                self.engine.abort(req.request_id)
            raise
        return _merged(self._run(requests, use_tqdm), choices)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template (given `tools` and any
        other template variables, e.g. {"enable_thinking": True}; `add_generation_prompt` as in
        vLLM and transformers) and generate the reply; each output's `prompt` is the rendered text.
        Content parts may hold images as vLLM's chat format does: {"type": "image_url", "image_url":
        {"url": "data:image/png;base64,..."}} (file:// and http(s) URLs as the engine allows them), or
        {"type": "image", "image": a PIL image, bytes or a path}; videos as {"type": "video_url",
        "video_url": {"url": "data:video/mp4;base64,..."}} or {"type": "video", "video": bytes or a path}."""
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts, texts = [], []
        for i, conversation in enumerate(conversations):
            rendered, media = split_chat_media(conversation, self._fetch)
            text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, tools=tools,
                                                      **(chat_template_kwargs or {}))
            encode = partial(self.tokenizer.encode, add_special_tokens=False)  # the template writes any BOS itself
            ids = encode(text)
            contents = "".join(m["content"] for m in rendered if isinstance(m.get("content"), str))
            self.tokenizer.warn_unknown(f"conversation {i}", contents, ids)
            # images and videos expanded in the text, as transformers' processor does (engine/multimodal.py)
            prompts.append(self._mm.expand_text(text, self._mm.load(media), encode) if media else ids)
            texts.append(text)
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _fetch(self, url: str, what: str, modality: str) -> bytes:
        processor = self._mm.processor(modality) if self._mm is not None else None
        if processor is None:  # refused with the reason once the engine counts it
            return url
        return fetch_url(url, self._media, processor.max_bytes, what, modality)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding what each committed canvas adds (output_kind "delta");
        the last output has finished=True. Closing the iterator early aborts the request."""
        request = self._inputs.request(prompt, replace(sampling_params or SamplingParams(), output_kind="delta"))
        if self.replicas is not None:
            yield from self.replicas.stream(request)
            return
        req = self.engine.add(request)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != req.request_id:
                        continue
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    yield out
                    if out.finished:
                        return
        finally:
            self.engine.abort(req.request_id)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(requests) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="Generating", unit="req")
        wanted = {r.request_id for r in requests}
        committed = 0
        try:
            while len(results) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        if out.error is not None:
                            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                # Requests end only after many canvases: the bar also moves with each committed one.
                if bar is not None and committed != (now := sum(r.metrics.committed_tokens for r in requests)):
                    committed = now
                    rate = committed / max(bar.format_dict["elapsed"], 1e-3)
                    bar.set_postfix_str(f"{committed} tokens committed, {rate:.1f} tok/s", refresh=False)
                    bar.update(0)  # redraws at tqdm's own pace, not at every step
        except BaseException:
            for req in requests:
                self.engine.abort(req.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r.request_id] for r in requests]

    def _run_replicas(self, requests: list[EngineRequest], use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm and len(requests) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="Generating", unit="req")
        try:
            return self.replicas.generate(requests, lambda done: bar.update(done - bar.n) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()

    def shutdown(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()
        else:
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        out = [prompts]
    elif isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        out = [list(p) if isinstance(p, tuple) else p for p in prompts]
    else:
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of these; got {type(prompts).__name__}")
    # "" as [] (which the engine refuses): the BOS token alone is no prompt.
    empty = [i for i, p in enumerate(out) if p == ""]
    if empty:
        raise ValueError(f"prompt is empty (prompt {empty[0]})")
    return out


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """One request's parameters per completion: choice i of a request seeded s draws from s + i,
    as the server's choices do."""
    n = params.n or 1
    if n == 1:
        return [params]
    return [replace(params, n=None, seed=None if params.seed is None else params.seed + i) for i in range(n)]


def _merged(outputs: list[RequestOutput], choices: list[tuple]) -> list[RequestOutput]:
    """One RequestOutput per prompt, its choices' completions in `outputs`, indexed 0..n-1 (vLLM's shape)."""
    merged: list[RequestOutput] = []
    for (i, _, _), out in zip(choices, outputs):
        if len(merged) == i:
            merged.append(out)
        else:
            merged[i].outputs.append(replace(out.outputs[0], index=len(merged[i].outputs)))
    return merged
