"""The tokenizer `bench serve` sizes its prompts with: a local checkpoint's (`--tokenizer`, or
`--model` when it is a directory), else the served model's own, through the server's `/tokenize`
and `/detokenize` (vLLM's endpoints, which blockdiff serves). vLLM's `bench serve` loads the
tokenizer locally from `--tokenizer` or `--model`; asking the server instead means a served name
such as `demo` is enough, and the counts are those of the tokenizer that will read the prompts."""

from __future__ import annotations

import httpx


class LocalTokenizer:
    """`encode` gives a text's ids without special tokens; `special_tokens` is what a completion
    prompt gets on top (BOS). ServerTokenizer has the same three members."""

    def __init__(self, tokenizer):
        self._tok = tokenizer  # blockdiff.tokenizer.Tokenizer
        self.special_tokens = 1 if tokenizer.add_bos else 0

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class ServerTokenizer:
    """The served model's tokenizer over HTTP. `probe` returns None when the server has no
    /tokenize (any OpenAI server that is neither blockdiff nor vLLM)."""

    def __init__(self, client: httpx.Client, base_url: str, model: str, headers: dict):
        self._client, self._base, self._model, self._headers = client, base_url, model, headers
        self.special_tokens = len(self._tokenize("a", True)) - len(self._tokenize("a", False))

    @classmethod
    def probe(cls, client: httpx.Client, base_url: str, model: str, headers: dict) -> "ServerTokenizer | None":
        try:
            return cls(client, base_url, model, headers)
        except (httpx.HTTPStatusError, KeyError, ValueError):
            return None

    def _post(self, path: str, body: dict) -> dict:
        resp = self._client.post(self._base + path, json={"model": self._model, **body}, headers=self._headers)
        resp.raise_for_status()
        return resp.json()

    def _tokenize(self, text: str, special: bool) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": special})["tokens"]

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text, False)

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]


PromptTokenizer = LocalTokenizer | ServerTokenizer
