"""The text each token of our tokenizer stands for, as bytes: what a token automaton reads.

A token's bytes are what it adds to the decoded text: SentencePiece-style vocabularies mark a
space with "▁" (Metaspace, or Gemma's Replace decoder), byte-fallback tokens `<0xNN>` are one raw
byte, and byte-level BPE (GPT-2's ByteLevel) spells every byte as one printable character. Special
tokens (added tokens flagged special: BOS, EOS, turn and tool markers) spell no text and are left
out, except those a constraint names as symbols of its alphabet (`SYMBOL_BASE`: the k-th named
special token reads as the private-use character chr(SYMBOL_BASE + k), which no ordinary token
spells), so that a tool-call format can require its marker tokens themselves.
"""

from __future__ import annotations

import functools
import json
import re

from blockdiff.tokenizer import Tokenizer

SYMBOL_BASE = 0xE000  # the first private-use code point
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>\Z")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, reversed."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_steps(decoder: dict | None) -> list[dict]:
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders", []) for s in _decoder_steps(d)]
    return [decoder]


def token_bytes(tokenizer: Tokenizer, symbols: tuple[str, ...] = ()) -> list[bytes | None]:
    """Per token id, the bytes it adds to the text (None: the token spells no text a constraint may
    use: a special token that is not one of `symbols`, or an empty one). `symbols`: special tokens
    that read as the characters chr(SYMBOL_BASE + k)."""
    spec = json.loads(tokenizer._tok.to_str())
    steps = _decoder_steps(spec.get("decoder"))
    kinds = {s.get("type") for s in steps}
    table = _byte_level_table() if "ByteLevel" in kinds else None
    space = "▁" if "Metaspace" in kinds or any(
        s.get("type") == "Replace" and s.get("pattern", {}).get("String") == "▁" for s in steps) else None
    byte_fallback = "ByteFallback" in kinds or bool(spec.get("model", {}).get("byte_fallback"))
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    named = {}
    for k, name in enumerate(symbols):
        i = tokenizer.token_to_id(name)
        if i is None:
            raise ValueError(f"the tokenizer has no token {name!r}")
        named[i] = k
    out: list[bytes | None] = []
    for i in range(tokenizer.vocab_size):
        t = tokenizer.id_to_token(i)
        if i in named:
            out.append(symbol(named[i]).encode())
        elif t is None or i in special:
            out.append(None)
        elif table is not None:
            out.append(bytes(table[c] for c in t) if all(c in table for c in t) else t.encode())
        elif byte_fallback and (m := _BYTE_TOKEN.match(t)):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append((t.replace(space, " ") if space else t).encode() or None)
    return out


def symbol(k: int) -> str:
    """The character the k-th named special token reads as, in a regex."""
    return chr(SYMBOL_BASE + k)


def longest_token(tokenizer: Tokenizer) -> int:
    """The most bytes one token spells (so the most characters): what bounds the text of N tokens."""
    return max((len(t) for t in token_bytes(tokenizer) if t), default=1)
