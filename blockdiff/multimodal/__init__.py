"""Multimodal inputs as the engine carries them, whatever their modality.

Each modality has a processor (an image: blockdiff/multimodal/image.py, a video:
blockdiff/multimodal/video.py) that checks an input against its bounds, decodes and preprocesses it
into one `MultiModalItem`: the tokens that replace its placeholder in the prompt, the runs of soft
tokens among them with the encoder input of each (an image is one run, a video one run a frame),
and a digest of its pixels. Past the processor nothing looks at the modality: the engine places the
runs (`Placeholder`), keys the prefix cache by the digest and hands the encoder the pixels of the
runs a step prefills. Which processors a checkpoint has is its architecture's (model/registry.py).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

import torch


class MediaError(ValueError):
    """An input of some modality that cannot be used; the message names the problem, and `code` (the
    server's error code) its modality: invalid_image or invalid_video."""

    code = "invalid_image"  # of an input whose modality is not known (a part the server cannot read): as an image's

    def __init__(self, message: str, modality: str | None = None):
        super().__init__(message)
        if modality is not None:
            self.code = f"invalid_{modality}"


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    modality: str  # "image", "video": for messages and counts only
    pixel_values: tuple[torch.Tensor, ...]  # per run [patches, 3 * patch_size**2] float32
    position_ids: tuple[torch.Tensor, ...]  # per run [patches, 2] long, (x, y)
    tokens: tuple[int, ...]  # what its placeholder token becomes in the prompt
    runs: tuple[tuple[int, int], ...]  # [start, end) of each run's soft tokens within `tokens`
    digest: bytes  # of its pixels and positions: equal items share prefix-cache blocks
    # `tokens` as text, what transformers' processor puts in place of the placeholder before it
    # tokenizes: a text prompt is expanded with it, since the text around a placeholder (a video
    # frame's timestamp) tokenizes with its neighbours. None without a tokenizer.
    text: str | None = None

    @property
    def soft_tokens(self) -> int:
        return sum(b - a for a, b in self.runs)


@dataclass(frozen=True, eq=False)
class Placeholder:
    """One run of an item's soft tokens in a prompt: [start, end) of the prompt's tokens."""

    item: MultiModalItem
    run: int
    start: int
    end: int

    @property
    def pixel_values(self) -> torch.Tensor:
        return self.item.pixel_values[self.run]

    @property
    def position_ids(self) -> torch.Tensor:
        return self.item.position_ids[self.run]


class Processor(Protocol):
    """A modality's processor, made per checkpoint by its architecture (model/registry.py)."""

    modality: str
    placeholder: int  # the token id the chat template writes for one input
    limit: int  # inputs one prompt may hold (--limit-mm-per-prompt)
    max_bytes: int  # of one encoded input, also the bound on fetching one

    def load(self, source, what: str) -> MultiModalItem: ...


def pixel_digest(*arrays: torch.Tensor) -> bytes:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.numpy().tobytes())
    return h.digest()


def _queues(items: list[MultiModalItem], counts: dict[str, int]) -> dict[str, list[MultiModalItem]]:
    """The items of each modality in order, checked against the placeholders the prompt holds."""
    queues = {m: [it for it in items if it.modality == m] for m in counts}
    for m, found in counts.items():
        if found != len(queues[m]):
            raise MediaError(f"the prompt has {found} {m} placeholders for {len(queues[m])} {m}s", m)
    return queues


def expand_text(text: str, items: list[MultiModalItem], placeholders: dict[str, tuple[str, int]],
                encode) -> tuple[list[int], list[Placeholder]]:
    """As transformers' processors expand a text prompt: each placeholder (`placeholders`: modality ->
    (its text, its token id)) replaced by its item's text, then the whole tokenized (`encode`); the
    runs are found among the ids, where each item's placeholder tokens now are."""
    queues = _queues(items, {m: text.count(t) for m, (t, _) in placeholders.items()})
    if not placeholders:
        return encode(text), []
    modality_of = {t: m for m, (t, _) in placeholders.items()}
    order: list[MultiModalItem] = []  # the items in the text's order
    taken = dict.fromkeys(placeholders, 0)

    def swap(match: re.Match) -> str:
        m = modality_of[match.group()]
        order.append(queues[m][taken[m]])
        taken[m] += 1
        return order[-1].text

    ids = encode(re.sub("|".join(map(re.escape, modality_of)), swap, text))
    runs, pos = [], 0
    for item in order:
        token = placeholders[item.modality][1]
        for r, (a, b) in enumerate(item.runs):
            start = ids.index(token, pos) if token in ids[pos:] else -1
            if start < 0 or ids[start:start + b - a] != [token] * (b - a):
                raise MediaError(f"the prompt's {item.modality} tokens do not come where its text put them",
                                 item.modality)
            runs.append(Placeholder(item, r, start, start + b - a))
            pos = start + b - a
    return ids, runs


def expand_placeholders(ids: list[int], items: list[MultiModalItem],
                        placeholders: dict[str, int]) -> tuple[list[int], list[Placeholder]]:
    """Each placeholder token of a rendered prompt -> its item's tokens, the items of each modality
    in the order given (`placeholders`: modality -> its placeholder token id). -> (ids, the runs)."""
    queues = _queues(items, {m: ids.count(token) for m, token in placeholders.items()})
    modality_of = {token: m for m, token in placeholders.items()}
    taken = {m: 0 for m in placeholders}
    out: list[int] = []
    runs: list[Placeholder] = []
    for t in ids:
        m = modality_of.get(t)
        if m is None:
            out.append(t)
            continue
        item = queues[m][taken[m]]
        taken[m] += 1
        runs += [Placeholder(item, r, len(out) + a, len(out) + b) for r, (a, b) in enumerate(item.runs)]
        out += item.tokens
    return out, runs
