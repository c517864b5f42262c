"""/tokenizer_info's body from a checkpoint's tokenizer files: vLLM's shape (special tokens as their
text), with no field that names a path on the server (tests/server/test_ecosystem_clients.py serves it)."""

from __future__ import annotations

import json
import shutil

from blockdiff.entrypoints.openai.tokenizer_info import tokenizer_info
from blockdiff.hub import DEMO_CHECKPOINT
from blockdiff.tokenizer import Tokenizer


def _tokenizer(tmp_path, config: dict, chat_template: str | None = None) -> Tokenizer:
    shutil.copy(f"{DEMO_CHECKPOINT}/tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_pretrained(str(tmp_path), chat_template=chat_template)


def test_added_tokens_are_their_text_and_paths_are_left_out(tmp_path):
    added = {"content": "<eos>", "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    info = tokenizer_info(_tokenizer(tmp_path, {
        "eos_token": {"__type": "AddedToken", **added}, "added_tokens_decoder": {"1": added},
        "vocab_file": "/srv/models/x/tokenizer.model", "tokenizer_file": "/srv/models/x/tokenizer.json",
        "name_or_path": "/srv/models/x", "model_max_length": 4096,
    }))
    assert info == {"eos_token": "<eos>", "added_tokens_decoder": {"1": "<eos>"}, "model_max_length": 4096,
                    "tokenizer_class": "PreTrainedTokenizerFast"}


def test_the_chat_template_is_the_one_the_server_renders(tmp_path):
    config = {"tokenizer_class": "GemmaTokenizer",
              "chat_template": [{"name": "default", "template": "{{ messages }}"}, {"name": "rag", "template": "x"}]}
    info = tokenizer_info(_tokenizer(tmp_path, config))
    assert (info["tokenizer_class"], info["chat_template"]) == ("GemmaTokenizer", "{{ messages }}")
    assert tokenizer_info(_tokenizer(tmp_path, config, chat_template="{{ 'mine' }}"))["chat_template"] == "{{ 'mine' }}"
    assert "chat_template" not in tokenizer_info(_tokenizer(tmp_path, {}))
