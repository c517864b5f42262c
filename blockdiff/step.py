"""The contract between the engine and the workers: what one step runs, what it returns, and the
KV-cache geometry the executor sized. Both sides import this module; it imports neither."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

UNREACHABLE = np.iinfo(np.int64).max // 2  # distance to acceptance of a state that never accepts


@dataclass
class StepParams:
    """A sampler's inputs of one step: tensors whose first dimension is the step's canvases, and
    Python values decided on the host that choose a code path (`options()`: a static step keeps one
    graph for each distinct set of them). Every sampler's start with the step count and the
    counters of the step's random numbers. Each rank keeps the tensors per slot, a row for each
    (worker/request_slots.py: `DiffusionSampler.params_table`), and a step selects its canvases' rows;
    a plan carries only the options (`step_options`)."""

    step: torch.Tensor  # [canvases] int32, steps remaining including this one (n)
    seed: torch.Tensor  # [canvases, 2] int64: the request's seed as two 32-bit words (randoms.seed_words)
    canvas: torch.Tensor  # [canvases] int64: the canvas's index in its request (0: the first)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}

    def later(self, steps: int) -> "StepParams":
        """The same canvases `steps` steps on: n counts down (to 1 at least: a canvas that finished
        before runs on masked, its results unused)."""
        return dataclasses.replace(self, step=(self.step - steps).clamp(min=1))

    def options(self) -> dict:
        """The Python values (what a plan carries: the ranks keep the tensors per slot)."""
        return {k: v for k, v in self.__dict__.items() if not isinstance(v, torch.Tensor)}

    def with_options(self, options: dict) -> "StepParams":
        return dataclasses.replace(self, **options)

    def select(self, index: torch.Tensor) -> "StepParams":
        """The rows `index` (of a per-slot table: the rows of a step's slots)."""
        return self._map(lambda v: v.index_select(0, index))

    def put(self, index: torch.Tensor, rows: "StepParams") -> None:
        """Write `rows` [len(index), ...] at rows `index` of this table (they may sit on the host)."""
        for k, v in rows.tensors().items():
            getattr(self, k).index_copy_(0, index, v.to(index.device))

    def _map(self, fn) -> "StepParams":
        return type(self)(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()})


def step_options(requests: list[dict[str, bool]]) -> dict[str, bool]:
    """A step's options from the options its canvases' requests raise (ResolvedParams.options, the
    sampler's `request_options`): each is set when any of them raises it."""
    return {name: any(r[name] for r in requests) for name in requests[0]} if requests else {}


@dataclass
class Automaton:
    """A token automaton over the model's vocabulary, in plain arrays (what the engine builds once
    per schema and sends to every rank). States are 0..num_states-1."""

    key: str  # names it in plans and caches (a digest of the constraint and the vocabulary)
    initial: int
    final: np.ndarray  # [states] bool: accepting
    distance: np.ndarray  # [states] int64: fewest tokens to an accepting state (UNREACHABLE: never)
    atom_of: np.ndarray  # [vocab] int32: each token's atom, -1 for a token no state allows
    src: np.ndarray  # [transitions] int32: one per (state, atom) allowed...
    atom: np.ndarray  # [transitions] int32
    dst: np.ndarray  # [transitions] int32: ...and the state it leads to

    @property
    def num_states(self) -> int:
        return len(self.final)

    @property
    def num_atoms(self) -> int:
        return int(self.atom_of.max(initial=-1)) + 1

    def walk(self, state: int, tokens: list[int]) -> int:
        """The state after `tokens` from `state`; ValueError if the automaton refuses one."""
        table = self._table
        for t in tokens:
            a = int(self.atom_of[t]) if 0 <= t < len(self.atom_of) else -1
            nxt = table.get((state, a))
            if nxt is None:
                raise ValueError(f"token {t} is not allowed in automaton state {state}")
            state = nxt
        return state

    @property
    def sources(self) -> frozenset[int]:
        """The states any token leaves."""
        out = self.__dict__.get("_sources")
        if out is None:
            out = self.__dict__["_sources"] = frozenset(self.src.tolist())
        return out

    @property
    def _table(self) -> dict[tuple[int, int], int]:
        table = self.__dict__.get("_lookup")
        if table is None:
            table = self.__dict__["_lookup"] = dict(zip(zip(self.src.tolist(), self.atom.tolist()), self.dst.tolist()))
        return table

    def __getstate__(self) -> dict:  # the lookup table is rebuilt where it is needed
        return {k: v for k, v in self.__dict__.items() if k not in ("_lookup", "_sources")}


@dataclass(frozen=True)
class CanvasConstraint:
    """What one canvas of a step must satisfy if it finishes."""

    row: int  # the canvas's decoder row in the step
    automaton: str  # Automaton.key
    state: int  # where the previous canvas left the automaton
    remaining: int  # tokens max_tokens leaves, this canvas's included
    ends: tuple[int, ...]  # token ids that end the output (EOS and stop tokens)
    # Positions before this take no end token (min_tokens not reached yet; only where every state
    # goes on, so that the canvas still has a path: vocabulary restrictions)
    ends_from: int = 0


@dataclass
class ImageInputs:
    """The images of one forward pass and where their soft tokens go.

    Every image is encoded whole; `feature_rows` picks rows of the concatenated soft tokens of all
    images (a prompt chunk may hold only the tail of an image whose head came from the prefix
    cache) and `token_index` names the packed tokens they replace, in the same order.
    """

    pixel_values: list[torch.Tensor]  # per image [patches, 3 * patch_size**2]
    position_ids: list[torch.Tensor]  # per image [patches, 2] (x, y)
    feature_rows: torch.Tensor  # [n] long
    token_index: torch.Tensor  # [n] long

    def to(self, device: torch.device) -> "ImageInputs":
        return ImageInputs([p.to(device) for p in self.pixel_values], [q.to(device) for q in self.position_ids],
                           self.feature_rows.to(device), self.token_index.to(device))


@dataclass(frozen=True)
class CacheConfig:
    num_slots: int  # requests that can hold cache at once (max_num_seqs)
    num_blocks: int  # full-attention blocks
    block_size: int
    max_model_len: int
    num_sliding_blocks: int | None = None  # sliding-layer blocks; None: as many as full ones
    # "auto": K/V stored in the model's dtype; "fp8" / "fp8_e4m3": float8_e4m3fn with per-layer scales
    # (docs/fp8.md, "FP8 KV cache").
    kv_cache_dtype: str = "auto"
    # fp8: each layer's scales from the first prefill's K/V (their max |x| over every rank), then fixed.
    calculate_kv_scales: bool = False

    @property
    def sliding_blocks(self) -> int:
        return self.num_blocks if self.num_sliding_blocks is None else self.num_sliding_blocks


@dataclass(frozen=True)
class AdapterPool:
    """The per-request adapters' pool of each rank (EngineConfig.adapter_pool): `slots` adapter slots
    on its device, adapters of rank up to `max_rank`, the `host_cache` most recently used kept read
    in host memory."""

    slots: int
    max_rank: int
    host_cache: int


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


@dataclass
class StepRow:
    """One row of a step: the slot whose request it runs, its mode and its new tokens. It starts at
    its slot's cached length, which every rank keeps (worker/request_slots.py): set when a request
    takes the slot (`NewRequests`), advanced by the length of each of the slot's encoder rows."""

    slot: int
    length: int  # a prompt chunk, a canvas to commit, a scored piece, or a canvas to denoise
    decoder: bool
    bidirectional: tuple[tuple[int, int], ...] = ()  # as Row.bidirectional (an image's soft tokens)


@dataclass
class Penalties:
    """vLLM's penalties and OpenAI's logit_bias of one request (SamplingParams), sent with its
    admission: what each rank keeps of them per slot (worker/penalties.py). The output committed
    after the admission reaches the ranks as encoder rows past `prompt` + `output`."""

    repetition: float
    presence: float
    frequency: float
    prompt: torch.Tensor  # [prompt tokens] int64: the prompt's ids (the repetition penalty's)
    output: torch.Tensor  # [tokens] int64: the output committed before this admission (a readmission's)
    bias_ids: torch.Tensor  # [k] int64 token ids, k <= MAX_LOGIT_BIAS
    bias: torch.Tensor  # [k] float32: what logit_bias adds to their logits


@dataclass
class NewRequests:
    """The requests that took a slot since the workers last heard (admitted, or readmitted after a
    preemption): what each rank keeps of them per slot on its device, sent once. A plan of requests
    that go on carries none of it; a request's later changes are the plan's canvas starts (their
    steps n and canvas index) and the rank's own advances (positions by encoder rows, n by steps)."""

    slots: list[int]
    positions: list[int]  # tokens of each one already in the cache (a prefix-cache hit: more than 0)
    # The sampler's per-request parameters, which each rank makes its StepParams rows of
    # (`DiffusionSampler.step_params`): each one's seed, the steps n and index of its canvas, and its
    # per-canvas field values as the edge resolved them (ResolvedParams.per_canvas).
    seeds: list[int]
    steps: list[int]
    canvases: list[int]
    per_canvas: list[dict[str, int | float]]
    # With adapters enabled: each one's adapter slot in the pool (-1: none); None: none has one
    adapters: list[int] | None = None
    # Each one's penalties and logit bias (None: it has none); None: none of them has any
    penalties: list[Penalties | None] | None = None


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
    # With adapters enabled: adapters to write into pool slots before the step (slot -> the
    # adapter's directory and the fingerprint its files must have), sent once when the engine gives
    # the slot a new adapter.
    adapter_loads: dict[int, tuple] = field(default_factory=dict)


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
    # A step with a canvas in the fast mode: [decoder rows, CL] bool, the positions settled after the
    # step (final: never renoised, never changed), and [decoder rows] the rows the model ran for each
    # canvas (None: every canvas ran its whole canvas at each step).
    settled: torch.Tensor | None = None
    rows_evaluated: list[int] | None = None
