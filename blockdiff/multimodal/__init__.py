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
from dataclasses import dataclass
from typing import Protocol

import torch


class MediaError(ValueError):
    """An input of some modality that cannot be used; the message names the problem."""

    code = "invalid_image"  # the server's error code (a URL refused before its kind is known: as an image's)


@dataclass(frozen=True, eq=False)
class MultiModalItem:
    modality: str  # "image", "video": for messages and counts only
    pixel_values: tuple[torch.Tensor, ...]  # per run [patches, 3 * patch_size**2] float32
    position_ids: tuple[torch.Tensor, ...]  # per run [patches, 2] long, (x, y)
    tokens: tuple[int, ...]  # what its placeholder token becomes in the prompt
    runs: tuple[tuple[int, int], ...]  # [start, end) of each run's soft tokens within `tokens`
    digest: bytes  # of its pixels and positions: equal items share prefix-cache blocks

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


def expand_placeholders(ids: list[int], items: list[MultiModalItem],
                        placeholders: dict[str, int]) -> tuple[list[int], list[Placeholder]]:
    """Each placeholder token of a rendered prompt -> its item's tokens, the items of each modality
    in the order given (`placeholders`: modality -> its placeholder token id). -> (ids, the runs)."""
    queues = {m: [it for it in items if it.modality == m] for m in placeholders}
    for m, token in placeholders.items():
        found = ids.count(token)
        if found != len(queues[m]):
            raise MediaError(f"the prompt has {found} {m} placeholders for {len(queues[m])} {m}s")
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
