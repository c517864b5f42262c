"""An EngineClient driven from synchronous code (the offline `LLM` over data-parallel replicas): the
client's event loop runs in a thread of its own, and each call waits for what it asked."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable, Coroutine, Iterator

from blockdiff.engine.async_engine import RequestFailed
from blockdiff.engine.client import EngineClient
from blockdiff.inputs import EngineRequest
from blockdiff.outputs import RequestOutput

_POLL_S = 0.2  # how often a waiting call wakes up (to report progress, and to be interruptible)


class SyncClient:
    def __init__(self, client: EngineClient):
        self.client = client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="blockdiff-client-loop", daemon=True)
        self._thread.start()
        self._run(self._start())

    async def _start(self) -> None:
        self.client.start()

    def _run(self, coro: Coroutine, on_wait: Callable[[], None] = lambda: None):
        """The coroutine's result, run on the client's loop; Ctrl-C (or any exception here) cancels it."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            while True:
                try:
                    return future.result(_POLL_S)
                except concurrent.futures.TimeoutError:
                    on_wait()
        except BaseException:
            future.cancel()
            raise

    def generate(self, requests: list[EngineRequest],
                 on_finished: Callable[[int], None] = lambda done: None) -> list[RequestOutput]:
        """The final outputs of `requests` (in their order); `on_finished(done)` is called from this
        thread as they finish."""
        finished: list[RequestOutput | None] = [None] * len(requests)
        done = [0]

        async def run() -> None:
            stream = await self.client.add(requests)
            try:
                async for index, out in stream:
                    if out.finished:
                        finished[index] = out
                        done[0] += 1
            except RequestFailed as e:
                raise RuntimeError(f"a request failed: {e}") from None
            finally:
                stream.abort()

        reported = [0]

        def progress() -> None:
            if done[0] != reported[0]:
                reported[0] = done[0]
                on_finished(done[0])

        self._run(run(), progress)
        progress()
        return finished

    def stream(self, request: EngineRequest) -> Iterator[RequestOutput]:
        """What each committed canvas of one request adds; closing the iterator early aborts it."""
        outputs: queue.Queue = queue.Queue()
        end = object()

        async def run() -> None:
            stream = None
            try:
                stream = await self.client.add([request])
                async for _, out in stream:
                    outputs.put(out)
            except Exception as e:
                outputs.put(e)
            finally:
                if stream is not None:
                    stream.abort()
                outputs.put(end)

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            while (item := outputs.get()) is not end:
                if isinstance(item, RequestFailed):
                    raise RuntimeError(f"the request failed: {item}")
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._run(self.client.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
