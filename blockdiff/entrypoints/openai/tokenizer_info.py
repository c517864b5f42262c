"""`GET /tokenizer_info` as vLLM serves it (behind --enable-tokenizer-info-endpoint): the
tokenizer's configuration, tokenizer_config.json's fields with special tokens as plain strings, its
class, and the chat template the server renders with. lm-evaluation-harness' `local-completions`
finds it (with /tokenize and /detokenize) and then tokenizes through the server, with no copy of
the tokenizer on the client's side."""

from __future__ import annotations

from typing import Any

from blockdiff.tokenizer import Tokenizer

# Fields naming files on the server's disk: vLLM drops vocab_file and merges_file; the others say
# as much about the server's file system, which /v1/models' `root` keeps to itself too.
_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")
# What transformers loads a bare tokenizer.json as, the class vLLM would name for such a checkpoint.
_FAST_TOKENIZER = "PreTrainedTokenizerFast"


def tokenizer_info(tokenizer: Tokenizer) -> dict[str, Any]:
    info = {name: _plain(value) for name, value in tokenizer.config.items() if name not in _PATH_FIELDS}
    info["tokenizer_class"] = tokenizer.config.get("tokenizer_class") or _FAST_TOKENIZER
    # The template the server renders (--chat-template over the checkpoint's), as vLLM reports it.
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    else:
        info.pop("chat_template", None)
    return info


def _plain(value: Any) -> Any:
    """AddedToken serializations as their text, as vLLM reports them (`eos_token: "<eos>"`)."""
    if isinstance(value, dict):
        if value.get("__type") == "AddedToken" or {"content", "special"} <= value.keys():
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
