"""What goes into an engine: one request, made once at the edge and taken by the engine as it is.

The edge (the server's RequestBuilder, `LLM`, through `InputProcessor.request`) tokenizes the
prompt, loads and expands its images and videos, resolves its sampling parameters for its length
and names its adapter and client; the engine checks the result against itself and schedules it.
It is plain data: it crosses to a data-parallel replica or a Ray Serve replica pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from blockdiff.multimodal import MultiModalItem, Placeholder
from blockdiff.sampling_params import ResolvedParams


@dataclass
class PromptInputs:
    """A prompt's tokens and media: its ids with each item's placeholder expanded, the items, and
    where their soft tokens sit (none for a text-only prompt)."""

    token_ids: list[int]
    items: list[MultiModalItem] = field(default_factory=list)
    placeholders: list[Placeholder] = field(default_factory=list)  # each run of soft tokens, in prompt order

    def keyed(self) -> list:
        """The ids with each item's soft tokens keyed by its digest, as the prefix cache keys them."""
        ids: list = list(self.token_ids)
        for p in self.placeholders:
            ids[p.start:p.end] = [p.item.digest] * (p.end - p.start)
        return ids


class Adapter(Protocol):
    """Weights a request runs with besides the base model's (the engine's adapter slots know the kind)."""

    @property
    def key(self) -> tuple:
        """Who it is: its kind, then what tells it apart (requests of equal keys share cached prefixes)."""
        ...

    @property
    def name(self) -> str: ...


@dataclass
class EngineRequest:
    prompt: PromptInputs
    params: ResolvedParams  # resolved for this prompt's length by the engine's sampler, at the edge
    text: str | None = None  # the prompt as text, when it came as text (what outputs report as `prompt`)
    adapter: Adapter | None = None  # the adapter it runs with; None: the base model
    client: str | None = None  # whose share of the slots it counts against (a client address); None: nobody's
    priority: int = 0  # requests are served first come, first served: the edge takes only 0
