"""A request and its small state machine.

    WAITING -> PREFILL -> DENOISE <-> COMMIT -> FINISHED
                  (any state) -> ABORTED

PREFILL runs the prompt through the encoder (in chunks if it is long); DENOISE runs decoder steps on
the current canvas until it converges; COMMIT runs the finished canvas through the encoder so the
next canvas can see it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from blockdiff.sampling_params import SamplingParams


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DENOISE = "denoise"
    COMMIT = "commit"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_canvas_time: float | None = None
    finished_time: float | None = None
    canvases: int = 0
    denoising_steps: int = 0
    canvas_positions_evaluated: int = 0
    committed_tokens: int = 0

    def as_dict(self) -> dict:
        t0 = self.arrival_time
        return {
            "canvases": self.canvases,
            "denoising_steps": self.denoising_steps,
            "canvas_positions_evaluated": self.canvas_positions_evaluated,
            "committed_tokens": self.committed_tokens,
            "time_to_first_canvas": None if self.first_canvas_time is None else self.first_canvas_time - t0,
            "total_time": None if self.finished_time is None else self.finished_time - t0,
        }


@dataclass(eq=False)  # identity: the scheduler's queues look requests up, and no two are the same request
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # with every default filled in
    eos_token_ids: tuple[int, ...]
    canvas_length: int
    seed: int  # params.seed, or one drawn by the engine
    state: State = State.WAITING
    slot: int | None = None
    blocks: tuple[int, ...] = ()
    num_cached: int = 0  # tokens whose K/V are in the cache
    steps_left: int = 0  # n of the canvas being denoised
    pending_commit: list[int] | None = None
    ends_with_stop_token: bool = False  # finished on a stop or EOS token (its text is not output)
    output_token_ids: list[int] = field(default_factory=list)  # committed canvases, trimmed at the end
    logprobs: list[dict] | None = None
    draft_token_ids: list[int] | None = None
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    generator: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        self.generator.manual_seed(self.seed % 2**64)
        if self.params.logprobs is not None:
            self.logprobs = []

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

    def initial_canvas(self, vocab_size: int) -> torch.Tensor:
        """Canvas k starts from draft[k*CL:(k+1)*CL], noise where the draft runs out."""
        cl = self.canvas_length
        canvas = torch.randint(0, vocab_size, (cl,), generator=self.generator)
        draft = self.params.draft or []
        chunk = draft[self.metrics.canvases * cl : (self.metrics.canvases + 1) * cl]
        if chunk:
            canvas[: len(chunk)] = torch.tensor(chunk)
        return canvas

    def step_draws(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random numbers of one denoising step: candidate-sampling uniforms and renoise tokens."""
        cl = self.canvas_length
        uniform = torch.rand(cl, generator=self.generator)
        renoise = torch.randint(0, vocab_size, (cl,), generator=self.generator)
        return uniform, renoise
