"""The seam between a server and the engines behind it: `EngineClient`.

A server (entrypoints/openai) reads and calls only this: the tokenizer, the limits, the sampler's
field table, parameter resolution and cost, statistics, and adding and aborting the requests of an
API call. Losing a tensor-parallel worker and restarting it happen behind it. `AsyncEngine`
(engine/async_engine.py) is the client of one local engine; a data-parallel router over several
engines is one more class implementing it.

A request is made once, at the edge, as an `EngineRequest` (blockdiff/inputs.py): its prompt
tokenized and its images and videos expanded (`mm.expand`), its SamplingParams resolved for its
length (`resolve`: what a server needs anyway to check a request's cost), its adapter and client
named. `add` takes it as it is; no engine resolves it again.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from blockdiff.diffusion.strategy import DiffusionSampler
from blockdiff.engine.multimodal import MultiModalIntake
from blockdiff.engine.input_processor import InputProcessor
from blockdiff.inputs import EngineRequest
from blockdiff.outputs import RequestOutput
from blockdiff.sampling_params import ResolvedParams, SamplingParams, StructuredOutputsParams
from blockdiff.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineLimits:
    """What one request may ask of the engine."""

    model: str  # the checkpoint the engine runs
    max_model_len: int  # prompt + output tokens
    max_num_seqs: int  # requests that run at once
    max_denoising_steps: int  # the steps limit of max_denoising_steps (and of the sampler's other step counts)
    canvas_length: int
    vocab_size: int


@dataclass(frozen=True)
class EngineStats:
    """The engine's state when asked (gauges), the totals it counts (counters), and its cache's shape."""

    num_running: int
    num_waiting: int
    num_free_slots: int
    kv_cache_usage: float  # of the full-attention blocks, 0..1
    kv_cache_blocks: int  # full-attention blocks in all
    prefix_cache_queries: int  # prompt tokens looked up at first admissions
    prefix_cache_hits: int
    num_preemptions: int
    block_size: int
    prefix_caching: bool
    kv_cache_free_blocks: int  # full-attention blocks that can be handed out (cached ones among them)
    prefix_cache_scope: str  # whose requests share cached prefixes (block_allocator.key_root)
    # the adapters (their names) of running and of waiting requests, and the device's adapter slots (0: none)
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    adapter_slots: int = 0

    @staticmethod
    def total(stats: list[EngineStats]) -> EngineStats:
        """Several engines' stats as one engine's: counts added, usage over all their blocks."""
        blocks = sum(s.kv_cache_blocks for s in stats)
        used = sum(s.kv_cache_usage * s.kv_cache_blocks for s in stats)
        return EngineStats(
            sum(s.num_running for s in stats), sum(s.num_waiting for s in stats), sum(s.num_free_slots for s in stats),
            used / max(1, blocks), blocks, sum(s.prefix_cache_queries for s in stats),
            sum(s.prefix_cache_hits for s in stats), sum(s.num_preemptions for s in stats),
            stats[0].block_size, stats[0].prefix_caching, sum(s.kv_cache_free_blocks for s in stats),
            stats[0].prefix_cache_scope, tuple(sorted({n for s in stats for n in s.running_adapters})),
            tuple(sorted({n for s in stats for n in s.waiting_adapters})), max(s.adapter_slots for s in stats))


class EngineStream(abc.ABC, AsyncIterator[tuple[int, RequestOutput]]):
    """The engine requests of one API call: iterate for (index, RequestOutput) in the order the
    engine produces them, until every request has finished; `abort()` ends what has not."""

    request_ids: list[str]

    @abc.abstractmethod
    def abort(self) -> None: ...



def structured_specs(requests: list[EngineRequest]) -> list[StructuredOutputsParams]:
    """The distinct structured outputs of one call's requests: what `EngineClient.prepare` builds."""
    return list({r.params.structured_outputs.key(): r.params.structured_outputs for r in requests
                 if r.params.structured_outputs is not None}.values())

class EngineClient(abc.ABC):
    """What a server uses of the engine(s) behind it. `add` raises ValueError (InvalidParam naming
    the field, for bad parameters; nothing is added then), QueueFull or EngineUnavailable.

    `on_step(seconds, engine)` is called after every step of an engine, `on_finish(finish_reason,
    prompt_tokens, generated_tokens, metrics, engine)` once per request that finished or was aborted
    after it was added (both on the event loop; finish_reason is "abort" for the latter); `engine`
    names the engine as `engine_stats` does. The server sets them (its metrics)."""

    tokenizer: Tokenizer | None
    limits: EngineLimits
    sampler: DiffusionSampler  # its field table is what the API offers for this model
    mm: MultiModalIntake  # the images and videos the model takes
    defaults: dict  # the sampler's field values a request that sets none of them gets
    on_step: Callable[..., None]
    on_finish: Callable[..., None]

    # The engine's input processor (a copy of it in front of remote engines): the one place where a
    # request's parameters are resolved and priced, whichever client serves it.
    inputs: InputProcessor

    def resolve(self, params: SamplingParams | None, prompt_len: int) -> ResolvedParams:
        """`params` with every default merged and every bound checked, for a prompt of
        `prompt_len` tokens (images expanded): once, at the edge; the engine takes the result as it is."""
        return self.inputs.resolve(params, prompt_len)

    def cost(self, params: ResolvedParams) -> int:
        """Canvas positions the decoder evaluates for a request at most."""
        return self.inputs.cost(params)

    def stats(self) -> EngineStats:
        """The engines' stats added up."""
        return EngineStats.total(list(self.engine_stats().values()))

    @abc.abstractmethod
    def engine_stats(self) -> dict[str, EngineStats]:
        """Each engine's stats, by its name ("0", "1", ...: its data-parallel rank)."""

    @abc.abstractmethod
    async def prepare(self, spec: StructuredOutputsParams, client: str | None = None) -> None:
        """Build the token automaton of a structured output off the event loop (cached; bounded in
        time and memory; builds queued fairly across `client`s), so that `add` does not; InvalidParam
        when it cannot be served. Cancelling it stops the build unless another request waits for it."""

    @abc.abstractmethod
    async def add(self, requests: list[EngineRequest]) -> EngineStream:
        """Queue the requests of one API call, all of one client (`EngineRequest.client`: the engine
        shares its slots fairly among clients, each engine request counting); -> their stream."""

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """End these requests, if they still run."""

    # ---- lifetime: started and stopped by the server, on its event loop ----------------------------
    @property
    @abc.abstractmethod
    def available(self) -> bool:
        """Whether a request can be added now."""

    @property
    @abc.abstractmethod
    def dead(self) -> bool:
        """The engine failed for good: the process should exit non-zero."""

    @abc.abstractmethod
    def unavailable_reason(self) -> str:
        """Why no request can be served now (for errors and /health)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def drain_threadsafe(self, grace: float) -> None:
        """Stop taking requests; those in flight get `grace` seconds. Callable from any thread."""

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None:
        """The synchronous part of stop(), also safe when the loop never ran."""
