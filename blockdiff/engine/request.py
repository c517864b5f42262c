"""A request and its state machine.

    WAITING -> PREFILL -> DENOISE <-> COMMIT -> FINISHED
       ^          |          |            |
       +----------+----------+------------+   preempted (fairness: at COMMIT; memory: any of the
                                              three), recomputed from its tokens later
    any live state -> ABORTED; a failed step -> FINISHED ("error")

PREFILL runs the request's uncached tokens through the encoder (the prompt, in chunks; after a
preemption, the prompt and every committed canvas), minus a cached prefix found at admission;
DENOISE runs decoder steps on the current canvas until it converges; COMMIT runs the finished canvas
through the encoder so the next canvas can see it. A request preempted while denoising drops its
canvas and denoises it again from its start: its random numbers are counted by (seed, canvas,
step, position) on the device (diffusion/randoms.py), so it draws the same ones again, with nothing
to rewind. Every transition goes through `to()`, which refuses illegal ones.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from blockdiff.engine.detokenizer import IncrementalDetokenizer
from blockdiff.inputs import Adapter
from blockdiff.multimodal import Placeholder
from blockdiff.outputs import TokenLogprob
from blockdiff.sampling_params import SamplingParams
from blockdiff.step import Penalties
from blockdiff.structured.compiler import OutputConstraint


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DENOISE = "denoise"
    COMMIT = "commit"
    FINISHED = "finished"
    ABORTED = "aborted"


_LEGAL = {
    State.WAITING: {State.PREFILL, State.ABORTED},
    State.PREFILL: {State.DENOISE, State.WAITING, State.ABORTED, State.FINISHED},
    State.DENOISE: {State.COMMIT, State.WAITING, State.ABORTED, State.FINISHED},
    State.COMMIT: {State.DENOISE, State.WAITING, State.ABORTED, State.FINISHED},
    State.FINISHED: set(),
    State.ABORTED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admission
    first_canvas_time: float | None = None
    last_canvas_time: float | None = None
    canvas_gaps: list[float] = field(default_factory=list)  # seconds between consecutive committed canvases
    finished_time: float | None = None
    canvases: int = 0
    denoising_steps: int = 0
    canvas_positions_evaluated: int = 0
    committed_tokens: int = 0
    preemptions: int = 0

    def as_dict(self) -> dict:
        t0 = self.arrival_time
        return {
            "canvases": self.canvases,
            "denoising_steps": self.denoising_steps,
            "canvas_positions_evaluated": self.canvas_positions_evaluated,
            "committed_tokens": self.committed_tokens,
            "preemptions": self.preemptions,
            "queue_time": None if self.scheduled_time is None else self.scheduled_time - t0,
            "time_to_first_canvas": None if self.first_canvas_time is None else self.first_canvas_time - t0,
            "total_time": None if self.finished_time is None else self.finished_time - t0,
            "canvas_gaps": list(self.canvas_gaps),
        }


@dataclass
class Draft:
    """The latest draft of a request's canvas being denoised: its argmax canvas (params.stream_drafts)
    and, with params.draft_details, that step's entropy and accepted positions."""

    token_ids: list[int] | None = None
    entropy: list[float] | None = None
    accepted: list[bool] | None = None


@dataclass(eq=False)  # identity: the scheduler's queues look requests up, and no two are the same request
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with every default filled in
    canvas_length: int
    seed: int  # params.seed, or one drawn by the engine: the key of the request's random numbers
    output: IncrementalDetokenizer
    state: State = State.WAITING
    slot: int | None = None
    blocks: list[int] = field(default_factory=list)  # full-layer block table (engine/kv_cache_manager.py)
    sliding_blocks: list[int] = field(default_factory=list)  # sliding-layer block table, -1 out of reach
    block_hashes: list[bytes] = field(default_factory=list)  # chained keys of the full blocks registered
    # Keys of the full blocks of prompt + output, for prefix lookups while the request waits; its
    # tokens only grow, so they stay valid until num_tokens changes.
    prefix_keys: list = field(default_factory=list)
    adapter: Adapter | None = None  # the adapter it runs with; None: the base model
    adapter_slot: int = -1  # the workers' pool slot its adapter holds while it is admitted (Scheduler.adapters)
    key_root: bytes | None = None  # the parent key of its first block: whom it shares cached K/V with (kv_cache_manager.py)
    num_cached: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    canvases_since_admitted: int = 0
    denoised_at: int = -1  # the scheduler's step in which its canvas last ran (engine/scheduler.py)
    steps_left: int = 0  # n of the canvas being denoised
    # A canvas started and not yet sent to the workers: its draft tokens [CL] (-1 where it starts
    # from the noise the workers draw).
    new_canvas: torch.Tensor | None = None
    draft: Draft = field(default_factory=Draft)  # its canvas's latest draft (stream_drafts, draft_details)
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    sent_tokens: int = 0  # how much of the output delta outputs have reported
    sent_pieces: int = 0
    # The runs of soft tokens of the prompt's images and videos, in order (blockdiff/multimodal)
    placeholders: list[Placeholder] = field(default_factory=list)
    client: str | None = None  # whose share of the slots it counts against (engine/scheduler.py); None: nobody's
    # Scoring the prompt (params.prompt_logprobs): its pieces [start, end), scored in turn while the
    # prompt is prefilled, and the scores of the pieces done (TokenLogprob per prompt token from the second).
    score_pieces: list[tuple[int, int]] = field(default_factory=list)
    prompt_scores: list[TokenLogprob] | None = None
    sent_prompt_scores: bool = False
    constraint: OutputConstraint | None = None  # structured outputs: what the committed text must be
    # The fast mode: tokens of the canvas being denoised already in the output (its settled prefix,
    # streamed before the canvas ends); they go through the encoder with the rest of the canvas.
    partial: int = 0

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            self.score_pieces = score_pieces(len(self.prompt_token_ids), self.canvas_length)
            self.prompt_scores = []

    def to(self, state: State) -> None:
        if state not in _LEGAL[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.value} -> {state.value}")
        self.state = state

    @property
    def finished(self) -> bool:
        return self.state in (State.FINISHED, State.ABORTED)

    @property
    def max_canvases(self) -> int:
        return -(-self.params.max_tokens // self.canvas_length)

    @property
    def max_cached_tokens(self) -> int:
        """Prompt plus every canvas but the last, which is never committed."""
        return len(self.prompt_token_ids) + (self.max_canvases - 1) * self.canvas_length

    @property
    def num_tokens(self) -> int:
        """Prompt and committed output: what the cache holds once the request is caught up."""
        return len(self.prompt_token_ids) + len(self.output.token_ids) - self.partial

    @property
    def streams_settled(self) -> bool:
        """Whether its canvas's settled prefix is output before the canvas ends (the fast mode), where
        nothing at the canvas's end could change it: no structured output or min_tokens rule left
        to apply there, and no logprobs, which a finished canvas reports."""
        p = self.params
        return (p.denoising_mode == "fast" and self.constraint is None and p.logprobs is None
                and p.min_tokens <= len(self.output.token_ids) - self.partial)

    def settled(self, canvas: list[int], settled: list[bool]) -> str | None:
        """Its canvas's argmax `canvas` after a step, with the positions settled: the leftmost run of
        settled positions is final, and what of it is new goes to the output; -> the finish reason
        (an EOS, a stop string or max_tokens in it), or None."""
        n = next((i for i, s in enumerate(settled) if not s), len(settled))
        if n <= self.partial:
            return None
        new = canvas[self.partial : n]
        self.partial = n
        return self.output.append(new)

    def penalties(self) -> Penalties | None:
        """What the workers keep of its penalties and logit bias when it takes a slot (None: none):
        the prompt, and the output committed so far (after a preemption), counted there once."""
        p = self.params
        if not p.penalized:
            return None
        bias = p.logit_bias or {}
        return Penalties(
            repetition=1.0 if p.repetition_penalty is None else float(p.repetition_penalty),
            presence=float(p.presence_penalty or 0), frequency=float(p.frequency_penalty or 0),
            prompt=torch.tensor(self.prompt_token_ids, dtype=torch.long),
            output=torch.tensor(self.output.token_ids, dtype=torch.long),
            bias_ids=torch.tensor(list(bias), dtype=torch.long),
            bias=torch.tensor(list(bias.values()), dtype=torch.float32))

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without joining the two."""
        p = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:min(end, p)] if start < p else []
        return head + self.output.token_ids[max(start - p, 0) : max(end - p, 0)]

    def key_tokens(self, start: int, end: int) -> list:
        """tokens(start, end) with the soft tokens of each image or video replaced by its digest:
        what the prefix cache hashes, so that prompts share blocks only where their inputs are equal too."""
        ids: list = self.tokens(start, end)
        for ph in self.placeholders:
            for p in range(max(ph.start, start), min(ph.end, end)):
                ids[p - start] = ph.item.digest
        return ids

    @property
    def mm_spans(self) -> list[tuple[int, int]]:
        """[start, end) of each run of soft tokens (an image, a video frame)."""
        return [(p.start, p.end) for p in self.placeholders]

    def splits_item(self, pos: int) -> tuple[int, int] | None:
        """The run of soft tokens that a cut before position `pos` falls inside, if any."""
        return next(((p.start, p.end) for p in self.placeholders if p.start < pos < p.end), None)

    # ---- scoring the prompt ---------------------------------------------------------------------
    @property
    def next_score_start(self) -> int | None:
        """Where the next piece to score starts: the prefix the cache must hold, and no more, when it
        is scored. None when nothing is left to score."""
        if self.prompt_scores is None:
            return None
        done = 1 + len(self.prompt_scores)  # the first prompt token is never scored
        return done if done < len(self.prompt_token_ids) else None

    @property
    def share(self) -> int:
        """What the request takes of each step, for fairness (engine/scheduler.py): its row, and while
        it scores its prompt, the canvas-sized piece it scores beside it."""
        return 1 if self.next_score_start is None else 2

    @property
    def canvas_steps_done(self) -> int:
        """The denoising steps its canvas has run: what a preemption now would throw away."""
        return self.params.max_denoising_steps - self.steps_left if self.state == State.DENOISE else 0

    def piece_to_score(self) -> tuple[int, int] | None:
        """The piece [start, end) to score now: the cache holds exactly the prompt before it."""
        start = self.next_score_start
        if start is None or self.num_cached != start:
            return None
        return next(p for p in self.score_pieces if p[0] == start)

    def prefills_after_scoring(self, piece: tuple[int, int]) -> bool:
        """Whether a piece goes through the encoder once scored: all but the last of a request that
        generates nothing."""
        return not (self.params.max_tokens == 0 and piece[1] == len(self.prompt_token_ids))

    def add_scores(self, scores: list[TokenLogprob]) -> bool:
        """A piece was scored; -> whether the request is done (it asked for no output)."""
        self.prompt_scores.extend(scores)
        return self.next_score_start is None and self.params.max_tokens == 0

    @property
    def max_hit(self) -> int:
        """The most tokens a prefix-cache hit may cover: a piece still to score needs the cache to
        hold the prompt before it only."""
        start = self.next_score_start
        return self.num_tokens if start is None else start

    def chunk(self, start: int, n: int) -> int:
        """A prompt chunk of `n` tokens from `start`, moved so it never ends inside an image: an
        image's tokens attend to each other and are encoded in one pass; nor past the start of a
        piece of the prompt still to score."""
        score = self.next_score_start
        if score is not None:  # the next piece start past `start`: the cache must hold no more when it is scored
            bound = next((a for a, _ in self.score_pieces if a > start and a >= score), None)
            if bound is not None and start + n > bound:
                n = bound - start
        span = self.splits_item(start + n)
        if span is None:
            return n
        return span[0] - start if span[0] > start else span[1] - start

    # ---- transitions ------------------------------------------------------------------------
    def admit(self, slot: int, num_cached: int) -> None:
        """Take a slot with `num_cached` tokens already in the cache (a prefix hit): a hit on every
        token starts the next canvas at once."""
        self.to(State.PREFILL)
        if self.metrics.scheduled_time is None:
            self.metrics.scheduled_time = time.monotonic()
        self.slot, self.num_cached, self.canvases_since_admitted = slot, 0, 0
        self.cached(num_cached)

    def preempt(self) -> None:
        """Give up the slot (the scheduler took the blocks back); the cache is rebuilt from the
        tokens on readmission. A canvas being denoised starts again, from the same random numbers."""
        if self.state == State.DENOISE:
            self.new_canvas = None
        self.to(State.WAITING)
        self.slot, self.num_cached = None, 0
        self.metrics.preemptions += 1

    def cached(self, n: int) -> None:
        """n more tokens went through the encoder; once caught up, the next canvas starts."""
        self.num_cached += n
        if self.num_cached == self.num_tokens:
            self.to(State.DENOISE)
            self._start_canvas()

    def _start_canvas(self) -> None:
        """Canvas k starts from draft[k*CL:(k+1)*CL], noise (the sampler's, on the workers) where the draft runs out."""
        cl = self.canvas_length
        canvas = torch.full((cl,), -1, dtype=torch.long)
        draft = self.params.draft or []
        chunk = draft[self.metrics.canvases * cl : (self.metrics.canvases + 1) * cl]
        if chunk:
            canvas[: len(chunk)] = torch.tensor(chunk)
        self.new_canvas = canvas
        self.steps_left = self.params.max_denoising_steps

    def denoised(self, argmax: list[int] | None, steps: int = 1, rows: int | None = None) -> None:
        """`steps` denoising steps ran, which evaluated `rows` canvas positions (None: the whole canvas
        at each); `argmax` is the last one's argmax canvas when drafts are streamed."""
        self.steps_left -= steps
        self.metrics.denoising_steps += steps
        self.metrics.canvas_positions_evaluated += steps * self.canvas_length if rows is None else rows
        if argmax is not None:
            self.draft.token_ids = argmax

    def commit(self, canvas: list[int], logprobs: list | None) -> str | None:
        """The canvas converged: add it to the output; -> the finish reason, or None (it goes to
        the encoder next)."""
        m = self.metrics
        m.canvases += 1
        self.canvases_since_admitted += 1
        now = time.monotonic()
        if m.first_canvas_time is None:
            m.first_canvas_time = now
        else:
            m.canvas_gaps.append(now - m.last_canvas_time)
        m.last_canvas_time = now
        before = len(self.output.token_ids) - self.partial
        reason = self.output.append(canvas[self.partial :], logprobs)
        self.partial = 0
        if self.constraint is not None:
            self.constraint.commit(self.output.token_ids[before:])
            if reason == "length" and self.constraint.complete:
                reason = "stop"  # the structured output is whole: nothing could have followed
        m.committed_tokens = len(self.output.token_ids)
        self.steps_left = 0
        if reason is None:
            self.to(State.COMMIT)
        return reason

    def finish(self, reason: str, error: str | None = None) -> None:
        self.to(State.ABORTED if reason == "abort" else State.FINISHED)
        self.finish_reason, self.error = reason, error
        self.metrics.finished_time = time.monotonic()


def score_pieces(prompt_len: int, canvas_length: int) -> list[tuple[int, int]]:
    """The pieces [start, end) a prompt is scored in: its tokens from the second on, cut into
    canvases counted back from its end (so the end, where a continuation is, sits in a whole canvas
    with as much of the prompt before it in the cache as possible); the first piece holds the rest."""
    starts = list(range(prompt_len - canvas_length, 1, -canvas_length))[::-1]
    bounds = [1, *starts, prompt_len] if prompt_len > 1 else []
    return list(zip(bounds[:-1], bounds[1:]))
