"""A request's CPU work off the event loop: bounded pools of threads, fair across clients, under a
per-request deadline.

Decoding and validating a body, rendering the chat template, tokenizing and decoding images run
here, never on the event loop, which only moves bytes. A pool has a fixed number of threads; the
tasks that wait for one are queued per client (its address) and served round robin, so a client
that floods the pool delays only its own requests.

The deadline: a request's work may take `timeout` seconds in all, counted from when its first task
starts (waiting for a thread does not count). At the deadline its caller gets a 413 at once, and
the work is abandoned: it stops at its next `check_deadline()`, which the JSON decoder calls every
few hundred values and the chat template on every item access, attribute access and call. A
thread cannot be killed, so what runs between two checks must be short: the C calls there (the
tokenizer, pydantic, a string copy) are bounded by the limits checked before them (limits.py).
Python code in a thread gives the GIL back every few milliseconds, and the tokenizer and Pillow
release it, so /health keeps answering while a pool works (docs/server.md, "Limits").
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.fairness import RoundRobin


class DeadlineExceeded(BaseException):
    """Raised inside abandoned work at its next check. A BaseException, as CancelledError is, so that
    no `except Exception` along the way (the template's, the decoder's) turns it into an answer."""


class Deadline:
    """The time a request's work may take: unstarted until its first task starts."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.end: float | None = None

    def start(self) -> None:
        if self.end is None:
            self.end = time.monotonic() + self.timeout

    def abandon(self) -> None:
        self.end = -float("inf")

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def check(self) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise DeadlineExceeded


_deadline: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("blockdiff_deadline", default=None)


def check_deadline() -> None:
    """Raise DeadlineExceeded if the current request's work is past its deadline (no-op outside one)."""
    deadline = _deadline.get()
    if deadline is not None:
        deadline.check()


def too_slow(timeout: float) -> APIError:
    return APIError(413, f"preparing this request took more than {timeout:g} s (--preprocess-timeout): the chat "
                         "template, tokenizer or images had too much to do; send less", code="request_too_complex")


@dataclass
class _Task:
    fn: Callable
    args: tuple
    context: contextvars.Context
    deadline: Deadline
    started: asyncio.Future
    done: asyncio.Future
    abandoned: bool = field(default=False)


class WorkPool:
    """`threads` threads; `run(client, fn, *args)` -> fn(*args), run on one of them."""

    def __init__(self, threads: int, timeout: float, name: str):
        self.threads, self.timeout = threads, timeout
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._busy = 0
        self._queue: RoundRobin[_Task] = RoundRobin()

    async def run(self, client: str, fn: Callable, *args: Any, deadline: Deadline | None = None) -> Any:
        """Raises what fn raises, or APIError 413 once the request's deadline (or the `deadline`
        given, for work that has its own) has passed."""
        if deadline is None:
            deadline = _deadline.get()
        if deadline is None:  # the request's first work: its deadline, shared by what follows
            deadline = Deadline(self.timeout)
            _deadline.set(deadline)
        loop = asyncio.get_running_loop()
        task = _Task(fn, args, contextvars.copy_context(), deadline, loop.create_future(), loop.create_future())
        self._queue.push(client, task)
        self._dispatch()
        try:
            await task.started
            return await asyncio.wait_for(asyncio.shield(task.done), deadline.remaining())
        except asyncio.TimeoutError:
            raise too_slow(deadline.timeout) from None
        except DeadlineExceeded:
            raise too_slow(deadline.timeout) from None
        finally:
            if not task.done.done():  # timed out, or the caller went away: the thread stops at its next check
                task.abandoned = True
                deadline.abandon()
                self._queue.remove(client, task)

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._busy < self.threads and self._queue:
            task = self._queue.pop()
            self._busy += 1
            task.deadline.start()
            future = self._executor.submit(task.context.run, task.fn, *task.args)
            future.add_done_callback(lambda f, task=task: loop.call_soon_threadsafe(self._finished, task, f))
            task.started.set_result(None)

    def _finished(self, task: _Task, future: Future) -> None:
        self._busy -= 1
        if task.abandoned or task.done.done() or future.cancelled():
            task.done.cancel()
        elif future.exception() is not None:
            task.done.set_exception(future.exception())
        else:
            task.done.set_result(future.result())
        self._dispatch()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
