"""`/tokenize` and `/detokenize` with vLLM's request and response shapes: a completion prompt or a
chat (rendered by the chat template, as /v1/chat/completions renders it) to token ids and back."""

from __future__ import annotations

from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.request_builder import generation_prompt
from blockdiff.entrypoints.openai.serving import OpenAIServing

_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")


class OpenAIServingTokenization:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.tokenizer = serving.tokenizer
        self.max_model_len = serving.limits.max_model_len

    def tokenize(self, req: p.TokenizeRequest) -> p.TokenizeResponse:
        self.serving.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send either prompt (text) or messages (a chat), not both or neither",
                           param="prompt" if req.prompt is not None else "messages")
        self._need_tokenizer("prompt" if req.prompt is not None else "messages")
        if req.prompt is not None:
            given = next((name for name in _CHAT_ONLY if getattr(req, name) is not None), None)
            if given:
                raise APIError(400, f"{given} applies to messages, not to a prompt", param=given)
            self.serving.preprocess.check_chars(len(req.prompt), "prompt")
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            ids = self.serving.preprocess.render_chat(req.messages, "tokenize", add_generation_prompt=generation_prompt(req),
                                                       tools=req.tools, chat_template_kwargs=req.chat_template_kwargs,
                                                       continue_final_message=bool(req.continue_final_message),
                                                       add_special_tokens=bool(req.add_special_tokens))
        strs = [self.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        self.serving.model_name(req.model)
        self._need_tokenizer("tokens")
        vocab = self.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds ids outside the vocabulary [0, {vocab}): {bad[:8]}", param="tokens")
        return p.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False))

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this checkpoint has no tokenizer", param=param)
