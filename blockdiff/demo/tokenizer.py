"""The demo model's character-level tokenizer: the special tokens, then one token per printable
ASCII character and the newline (ids fixed, so the chat template's markers are single tokens)."""

from __future__ import annotations

import string

from blockdiff.model.tiny import SPECIAL_TOKENS

CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII and "\n"
VOCAB = [*SPECIAL_TOKENS, *CHARACTERS]


def build_char_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models

    # BPE without merges: every character is its own token, anything else is <unk>.
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = decoders.Fuse()
    return tok
