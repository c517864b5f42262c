"""The contract between the engine and the workers: what one step runs, what it returns, and the
KV-cache geometry the executor sized. Both sides import this module; it imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockdiff.diffusion.constrained import Automaton, CanvasConstraint
from blockdiff.diffusion.strategy import StepParams
from blockdiff.model.attention import Row
from blockdiff.model.vision import ImageInputs


@dataclass(frozen=True)
class CacheConfig:
    num_slots: int  # requests that can hold cache at once (max_num_seqs)
    num_blocks: int  # full-attention blocks
    block_size: int
    max_model_len: int
    num_sliding_blocks: int | None = None  # sliding-layer blocks; None: as many as full ones

    @property
    def sliding_blocks(self) -> int:
        return self.num_blocks if self.num_sliding_blocks is None else self.num_sliding_blocks


@dataclass
class ScorePlan:
    """Pieces of prompts scored this step (docs/architecture.md, "Scoring"): each piece goes through
    the decoder as a clean canvas over its request's cached prefix (writing nothing), and the
    log-probability of each of its own tokens comes back."""

    ids: torch.Tensor  # [tokens] int64: the pieces, one after another
    lengths: list[int]  # tokens of each piece
    top: int = 0  # top alternatives per token (0: none)


@dataclass
class MinTokens:
    """Decoder rows whose canvas may not commit a stop token (EOS, stop_token_ids) in its first
    positions (SamplingParams.min_tokens): such a position takes its most likely other token."""

    banned: torch.Tensor  # [decoder rows, K] int64 token ids, -1 padding
    before: torch.Tensor  # [decoder rows] int64: canvas positions below this may not commit them (0: none)


@dataclass
class TableDelta:
    """What changed in the block tables of a step's requests since the workers last heard. Each
    rank keeps one table per layer kind for every slot on its device (worker/block_tables.py), so a
    plan carries only this, and a steady-state step's message does not grow with the context.
    Applied in order: the slots in `reset` (a request took them) are cleared to -1, then entry
    [slot, index] of the full or sliding table takes its block id."""

    reset: list[int]
    full: torch.Tensor  # [n, 3] int64 rows of (slot, index, block)
    sliding: torch.Tensor  # [m, 3] int64; a sliding block given back later is left as it was: out of every query's reach

    @classmethod
    def of(cls, reset: list[int], full: list[tuple[int, int, int]], sliding: list[tuple[int, int, int]]) -> "TableDelta":
        return cls(reset, torch.tensor(full, dtype=torch.long).view(-1, 3), torch.tensor(sliding, dtype=torch.long).view(-1, 3))

    @classmethod
    def whole(cls, rows: list[Row]) -> "TableDelta":
        """The rows' own tables (`Row.blocks`, `Row.sliding_blocks`) written whole: for plans
        built by hand, outside an engine."""
        by_slot = {r.slot: r for r in rows}
        full = [(s, i, b) for s, r in by_slot.items() for i, b in enumerate(r.blocks)]
        sliding = [(s, i, b) for s, r in by_slot.items()
                   for i, b in enumerate(r.blocks if r.sliding_blocks is None else r.sliding_blocks)]
        return cls.of(list(by_slot), full, sliding)


@dataclass
class StepRow:
    """One row of a step: the slot whose request it runs, its mode and its new tokens. It starts at
    its slot's cached length, which every rank keeps (worker/request_slots.py): set when a request
    takes the slot (`NewRequests`), advanced by the length of each of the slot's encoder rows."""

    slot: int
    length: int  # a prompt chunk, a canvas to commit, a scored piece, or a canvas to denoise
    decoder: bool
    bidirectional: tuple[tuple[int, int], ...] = ()  # as Row.bidirectional (an image's soft tokens)

    @classmethod
    def of(cls, row: Row) -> "StepRow":
        return cls(row.slot, row.length, row.decoder, row.bidirectional)


@dataclass
class NewRequests:
    """The requests that took a slot since the workers last heard (admitted, or readmitted after a
    preemption): what each rank keeps of them per slot on its device, sent once. A plan of requests
    that go on carries none of it; a request's later changes are the plan's canvas starts (their
    steps n and canvas index) and the rank's own advances (positions by encoder rows, n by steps)."""

    slots: list[int]
    positions: list[int]  # tokens of each one already in the cache (a prefix-cache hit: more than 0)
    params: StepParams  # [len(slots)] the sampler's per-request parameters: seed, per-canvas fields

    @classmethod
    def of(cls, rows: list[Row], params: StepParams) -> "NewRequests":
        """The requests of `rows` (one per slot, in order of first appearance) from their rows' starts,
        with `params` of one row per slot: for plans built by hand, outside an engine."""
        starts = {r.slot: r.start for r in rows}
        return cls(list(starts), list(starts.values()), params)


@dataclass
class StepPlan:
    rows: list[StepRow]  # encoder rows first, then the decoder rows: scored pieces, then the canvases being denoised
    encoder_ids: torch.Tensor  # [encoder tokens] int64
    new_canvas_rows: list[int]  # canvas rows (0-based among them) that start a canvas
    new_canvases: torch.Tensor  # [len(new_canvas_rows), CL] int64 draft tokens; -1: the sampler's noise
    # The sampler's step options (the Python values of its StepParams, `StepParams.options`) when the
    # step denoises canvases; None: it denoises none. The per-canvas parameters are the ranks' own.
    denoise: dict | None
    top_logprobs: int = -1  # -1: none; else the largest number of top logprobs asked for
    draft_details: bool = False  # some canvas asks for its step's entropy and accepted positions
    images: ImageInputs | None = None  # the images of this step's prompt chunks (every rank encodes them)
    score: ScorePlan | None = None  # its rows are the first decoder rows, before the canvases
    min_tokens: MinTokens | None = None  # over the canvas rows
    # Structured outputs: what the constrained canvases must commit if they finish, the automata the
    # workers have not been sent yet (they keep them by key), and those they may drop.
    constraints: list[CanvasConstraint] = field(default_factory=list)
    automata: dict[str, Automaton] = field(default_factory=dict)
    forget_automata: tuple[str, ...] = ()
    tables: TableDelta | None = None  # None: no table changed
    new_requests: NewRequests | None = None  # None: no request took a slot
    # Of each canvas that starts (new_canvas_rows): its steps n (the first step's) and its index in its request.
    new_canvas_steps: list[int] = field(default_factory=list)
    new_canvas_index: list[int] = field(default_factory=list)
    steps: int = 1  # denoising steps run back to back (only where every row is a canvas: the static step)


@dataclass
class StepOutput:
    finished: torch.Tensor  # [decoder rows] bool
    tokens: torch.Tensor  # [decoder rows, CL] what each canvas commits if finished (the argmax canvas,
    # for the entropy-bound sampler; its draft while it goes on)
    logprob: torch.Tensor | None  # [decoder rows, CL] logprob of each token
    top_logprobs: torch.Tensor | None  # [decoder rows, CL, k]
    top_ids: torch.Tensor | None
    # With plan.draft_details only: [decoder rows, CL] the step's entropy per position, and whether
    # the step kept its sampled token there (False: renoised).
    entropy: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    # With plan.score: [score tokens] each scored token's logprob, and [score tokens, top] alternatives
    score_logprob: torch.Tensor | None = None
    score_top_logprobs: torch.Tensor | None = None
    score_top_ids: torch.Tensor | None = None
    # [decoder rows] int32: denoising steps each canvas ran, up to the one that finished it (plan.steps > 1)
    steps: torch.Tensor | None = None
