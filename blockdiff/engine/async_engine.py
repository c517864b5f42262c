"""Drives an LLMEngine from asyncio: one task steps the engine while requests come and go. It is
the `EngineClient` of one local engine (engine/client.py).

The blocking `engine.step()` runs on a dedicated worker thread, so the event loop keeps answering
HTTP while the model computes. Every change to the engine's set of requests (add, abort) is applied
on the event loop between two steps, never while a step runs, so the engine needs no locking.

Losing a tensor-parallel worker (`WorkerLost`: dead, or silent past the worker timeout, noticed by
a step or, while idle, by a heartbeat) is not the end: the requests that had started end with
EngineUnavailable, the executor starts new workers (at most RESTART_TRIES times in a row), and the
requests still waiting run on them. Only if every try fails does the engine stop for good (`dead`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from blockdiff.engine.client import EngineClient, EngineStats, EngineStream
from blockdiff.engine.engine import LLMEngine
from blockdiff.inputs import EngineRequest
from blockdiff.outputs import RequestOutput
from blockdiff.parallel.ranks import WorkerLost
from blockdiff.sampling_params import StructuredOutputsParams
from blockdiff.structured.builds import BuildCancelled

log = logging.getLogger(__name__)

RESTART_TRIES = 3
# After SIGTERM's grace, how long stop() waits for the step in flight before it stops the workers
# under it (a hung worker would hold that step for the whole worker timeout).
STOP_WAIT_S = 2.0
WORKER_LOST = "a tensor-parallel worker was lost"


class EngineUnavailable(RuntimeError):
    """The engine is stopping or has failed; no request can be served."""


class RequestFailed(RuntimeError):
    """The engine step that ran this request raised; the engine goes on serving the others."""


class QueueFull(RuntimeError):
    """More requests are waiting than the configured limit allows."""


class StreamOverflow(RuntimeError):
    """The reader of a stream left more of its outputs unread than the stream's bound."""


def _approx_bytes(out: RequestOutput) -> int:
    """Roughly what an output takes queued, and then as JSON: its text, ids and logprob entries."""
    o = out.outputs[0]
    entries = sum(1 + len(lp.top) for lp in o.token_logprobs) if o.token_logprobs else 0
    return len(o.text or "") + 8 * (len(o.token_ids) + len(out.draft_token_ids or ())) + 64 * entries


class RequestStream(EngineStream):
    """The engine requests of one API call. Iterate for (index, RequestOutput) in the order the
    engine produces them; iteration ends once every request has finished."""

    def __init__(self, engine: EngineClient, request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue[tuple[RequestOutput | BaseException, int]] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self.unread = 0  # approximate bytes of the outputs queued and not read yet
        self.max_unread: int | None = None  # past it, the call ends and `overflowed` is set
        self.overflowed = asyncio.Event()

    def _put(self, item: RequestOutput | BaseException) -> None:
        size = _approx_bytes(item) if isinstance(item, RequestOutput) else 0
        self.unread += size
        if self.max_unread is not None and self.unread > self.max_unread and not self.overflowed.is_set():
            while not self._queue.empty():  # nobody will read these
                self._queue.get_nowait()
            self.unread, size = 0, 0
            item = StreamOverflow(f"more than {self.max_unread} bytes of output were left unread")
            self.overflowed.set()
            self.abort()
        self._queue.put_nowait((item, size))

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished and self._queue.empty():  # an error put before abort() is still read
            raise StopAsyncIteration
        item, size = await self._queue.get()
        self.unread -= size
        if isinstance(item, BaseException):
            self.abort()  # the call fails whole: its other requests stop too
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    def abort(self) -> None:
        """Abort whatever has not finished (a no-op once everything has)."""
        if self._unfinished:
            self._engine.abort([rid for rid in self.request_ids if rid in self._unfinished])
            self._unfinished.clear()


class AsyncEngine(EngineClient):
    """Owns `engine` from `start()` on: `stop()` shuts it down. It is engine `str(data_parallel_rank)`
    to on_step and on_finish (EngineClient)."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queued_requests: int | None = None,
        on_step: Callable[[float], None] | None = None,
        on_finish: Callable[[str, int, int, dict], None] | None = None,
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.limits = engine.limits
        self.sampler = engine.sampler
        self.inputs = engine.inputs
        self.mm = engine.inputs.mm
        self.defaults = engine.inputs.defaults
        self.name = str(engine.cfg.replica)
        self.max_queued_requests = max_queued_requests
        self.on_step = on_step or (lambda seconds, engine="0": None)
        self.on_finish = on_finish or (lambda finish_reason, prompt_tokens, generated_tokens, metrics, engine="0": None)
        self._streams: dict[str, RequestStream] = {}
        self._adds: list[tuple[RequestStream, list[EngineRequest], asyncio.Future]] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="blockdiff-engine")
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False  # no new requests (draining or stopping); the loop still steps
        self._stopping = False  # the loop exits before its next step
        self._stopped = False
        self._restarting = False
        self.error: BaseException | None = None
        self._dead = False  # the workers could not be restarted

    # ---- EngineClient: what the engine offers -------------------------------------------------
    def engine_stats(self) -> dict[str, EngineStats]:
        return {self.name: self.engine.stats()}

    @property
    def dead(self) -> bool:
        return self._dead

    @property
    def available(self) -> bool:
        return self._task is not None and not self._closed and self.error is None and not self._restarting

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="blockdiff-engine-loop")

    def drain_threadsafe(self, grace: float) -> None:
        """Stop taking requests; those in flight get `grace` seconds to finish, then they end with
        EngineUnavailable and are aborted. Callable from a signal handler or another thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain, grace)

    def _drain(self, grace: float) -> None:
        if not self._closed:
            self._closed = True
            asyncio.get_running_loop().call_later(grace, self._abort_all)

    def _abort_all(self) -> None:
        self._fail_all(EngineUnavailable(self.unavailable_reason()))
        self._wake.set()

    def _fail_all(self, exc: EngineUnavailable) -> None:
        """End every API call with `exc`: those still waiting to be added and those in the engine,
        whose requests are queued for abort."""
        for _, _, future in self._adds:
            if not future.done():
                future.set_exception(exc)
        self._adds.clear()
        for stream in set(self._streams.values()):
            stream._put(exc)
        self._aborts.extend(self._streams)
        self._streams.clear()

    async def prepare(self, spec: StructuredOutputsParams, client: str | None = None) -> None:
        structured = self.engine.structured
        if structured is None:
            return
        key = structured.key(spec)
        if structured.cached(key) is not None:  # at once: a cached automaton never waits behind a build
            return
        # The job (the regex of a choice, the vocabulary's bytes) is made off the loop.
        build = await asyncio.to_thread(structured.start, key, spec, client or "")
        try:
            # Shielded: the build is shared, and only `leave` may stop it.
            await asyncio.shield(asyncio.wrap_future(build.future))
        except asyncio.CancelledError:  # this request went away
            structured.leave(build)
            raise
        except BuildCancelled:  # the engine is stopping: its builds were killed
            raise EngineUnavailable(self.unavailable_reason()) from None

    async def add(self, requests: list[EngineRequest]) -> RequestStream:
        """Queue the requests of one API call (the scheduler shares the slots fairly among their
        clients, each request counting); -> their stream. Raises ValueError (bad input, nothing is
        queued then), QueueFull or EngineUnavailable."""
        if not self.available:
            raise EngineUnavailable(self.unavailable_reason())
        if self.max_queued_requests is not None:
            # Those that a free slot takes at the next step do not wait.
            queued = (self.engine.num_waiting + sum(len(r) for _, r, _ in self._adds) + len(requests)
                      - self.engine.num_free_slots)
            if queued > self.max_queued_requests:
                raise QueueFull(
                    f"{queued} requests would be waiting, more than --max-queued-requests={self.max_queued_requests}; retry later"
                )
        stream = RequestStream(self, [f"req-{next(self._ids)}" for _ in requests])
        future = asyncio.get_running_loop().create_future()
        self._adds.append((stream, requests, future))
        self._wake.set()
        try:
            await future
        except asyncio.CancelledError:
            # The caller went away; if the requests made it into the engine, take them out again.
            if future.done() and not future.cancelled() and future.exception() is None:
                stream.abort()
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Applied on the event loop between two steps."""
        self._aborts.extend(request_ids)
        self._wake.set()

    async def stop(self) -> None:
        """Finish the step in flight, abort every request, and shut the engine down."""
        if self._stopped:
            return
        self._closed = self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), STOP_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("the engine step did not end within %g s; stopping the workers under it", STOP_WAIT_S)
                self.engine.shutdown()  # a step blocked on a worker fails once the workers are gone
                await self._task
        self.shutdown()

    def shutdown(self) -> None:
        """Synchronous part of `stop()`, also safe when the loop never ran."""
        if self._stopped:
            return
        self._stopped = True
        self._closed = self._stopping = True
        self._fail_all(EngineUnavailable(self.unavailable_reason()))
        self._apply_aborts()
        self._worker.shutdown(wait=True)
        self.engine.shutdown()
        log.info("engine shut down")

    # ---- the loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping:
                self._wake.clear()
                self._apply_aborts()
                await self._apply_adds()
                try:
                    if not self.engine.has_unfinished():
                        await self._idle()
                        continue
                    outputs = await loop.run_in_executor(self._worker, self.engine.step)
                except WorkerLost as e:
                    if self._stopping:
                        break
                    await self._recover(e)
                    continue
                self.on_step(self.engine.last_step_time, self.name)
                for out in outputs:
                    self._deliver(out)
        except Exception as e:
            if self._stopping:  # stop() took the workers away under a step
                return
            log.exception("engine step failed; no further requests will be served")
            self.error = e
            self._fail_all(EngineUnavailable(self.unavailable_reason()))

    async def _idle(self) -> None:
        """Wait for work. Every half worker timeout without any, the workers must answer within the
        other half: an idle engine notices a lost worker within the worker timeout."""
        half = self.engine.cfg.worker_timeout / 2
        try:
            await asyncio.wait_for(self._wake.wait(), half)
        except asyncio.TimeoutError:
            await asyncio.get_running_loop().run_in_executor(self._worker, self.engine.executor.heartbeat, half)

    async def _recover(self, lost: WorkerLost) -> None:
        """End the requests that had started, restart the workers, go on with the waiting ones."""
        log.error("%s: %s; restarting the workers", WORKER_LOST, lost)
        self._restarting = True
        error = EngineUnavailable(f"{WORKER_LOST} while this request ran; the workers are restarting: retry")
        for req in self.engine.reset_after_worker_loss():
            self._count_abort(req)
            stream = self._streams.pop(req.request_id, None)
            if stream is not None:
                stream._put(error)
                stream.abort()  # its other requests, if any, are still waiting: they go too
        loop = asyncio.get_running_loop()
        for attempt in range(1, RESTART_TRIES + 1):
            if self._stopping:
                return
            try:
                await loop.run_in_executor(self._worker, self.engine.executor.restart)
            except Exception as e:
                log.error("restart %d of %d failed: %s", attempt, RESTART_TRIES, e)
                continue
            log.info("workers restarted (try %d); serving again", attempt)
            self._restarting = False
            return
        self.error = lost
        self._dead = True
        self._restarting = False
        self._fail_all(EngineUnavailable(self.unavailable_reason()))

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:  # aborted while this step ran
            return
        stream._put(out if out.error is None else RequestFailed(out.error))
        if out.finished:
            del self._streams[out.request_id]
            self.on_finish(out.finish_reason, len(out.prompt_token_ids), out.metrics["committed_tokens"], out.metrics,
                           self.name)

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            self._finish_aborted(rid)

    def _finish_aborted(self, rid: str) -> None:
        """Abort `rid` if the engine still has it (a finished request is no longer there)."""
        self._streams.pop(rid, None)
        req = self.engine.requests.get(rid)
        self.engine.abort(rid)
        if req is not None:
            self._count_abort(req)

    def _count_abort(self, req) -> None:
        """on_finish for a request that ends without an output (its text is never decoded)."""
        self.on_finish("abort", len(req.prompt_token_ids), len(req.output.token_ids), req.metrics.as_dict(), self.name)

    async def _apply_adds(self) -> None:
        """Add the waiting calls' requests to the engine. The engine's thread does it, between two
        steps as every change to its requests: a request's own work (its prompt and lists copied and
        checked, a call of 2,048 of them) never runs on the event loop."""
        adds, self._adds = [a for a in self._adds if not a[2].cancelled()], []
        if not adds:
            return
        if not self.available:
            for _, _, future in adds:
                future.set_exception(EngineUnavailable(self.unavailable_reason()))
            return
        results = await asyncio.get_running_loop().run_in_executor(self._worker, self._add_calls, adds)
        for (stream, _, future), error in zip(adds, results):
            if future.done():  # the caller went away meanwhile, or the engine is failing every call
                if error is None:
                    stream.abort()
            elif error is not None:
                future.set_exception(error)
            else:
                for rid in stream.request_ids:
                    self._streams[rid] = stream
                future.set_result(None)

    def _add_calls(self, adds) -> list[Exception | None]:
        """(In the engine's thread) each call's requests, all or none of them; -> each call's error."""
        errors = []
        for stream, requests, _ in adds:
            added = []
            try:
                for rid, request in zip(stream.request_ids, requests):
                    self.engine.add(request, rid)  # before the next step, which is the first to schedule it
                    added.append(rid)
                errors.append(None)
            except Exception as e:
                for rid in added:
                    self.engine.abort(rid)
                errors.append(e)
        return errors

    def unavailable_reason(self) -> str:
        """Why no request can be served now (for errors and /health)."""
        if self.error is not None:
            if isinstance(self.error, WorkerLost):  # its message names PIDs, for the log only
                return f"{WORKER_LOST} and could not be restarted; the server is exiting"
            return f"the engine failed: {self.error}"
        if self._closed:
            return "the server is shutting down"
        if self._restarting:
            return f"{WORKER_LOST}; the workers are restarting: retry shortly"
        return "the engine is not running"
