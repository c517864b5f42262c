"""Automaton builds in child processes: a few at a time, fair across clients, each bounded in time
and memory, and stopped when nobody waits for it any more.

A build is `index.py` in a fresh interpreter (outlines-core releases the GIL, but a thread could
not be stopped at its bounds). The child limits its own address space to `memory` bytes
(RLIMIT_AS) and asks the kernel to kill it when the thread that started it ends (PR_SET_PDEATHSIG):
the pool's threads live as long as the server, so a server killed outright leaves no build behind,
and `close()` kills the running ones on an orderly shutdown.

Waiting builds are queued per client and started round robin, so a client that sends many new
schemas delays its own builds, not another client's. A build every waiter has left is killed (or
never started).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from typing import Any
from collections.abc import Callable
from concurrent.futures import Future

from blockdiff.fairness import RoundRobin
from blockdiff.sampling_params import InvalidParam

log = logging.getLogger(__name__)
# A build is one thread of numpy: BLAS and OpenMP pools would only reserve address space and cores.
_CHILD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class BuildCancelled(Exception):
    """Every request waiting for the build went away before it finished."""


class Build:
    """One constraint's build: its pickled job, the client that asked first, how many requests
    wait for it, its child process while it runs, and its outcome (`future`: the index arrays)."""

    def __init__(self, key: str, client: str, job: bytes):
        self.key, self.client, self.job = key, client, job
        self.future: Future = Future()
        self.waiters = 1
        self.cancelled = False
        self.proc: subprocess.Popen | None = None


class BuildPool:
    """`workers` threads, each running one build's child process at a time. `done(build, outcome)`
    (the index arrays, or the exception the build ended with) runs in the build's thread and gives
    the build's result, or raises its error, before anyone waiting on the future sees it."""

    def __init__(self, workers: int, timeout: float, memory: int, done: Callable[[Build, dict | BaseException], Any]):
        self.workers, self.timeout, self.memory, self.done = workers, timeout, memory, done
        self._queue: RoundRobin[Build] = RoundRobin(newcomers_first=True)
        self._running: set[Build] = set()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, build: Build) -> None:
        with self._cond:
            if self._closed:
                build.future.set_exception(BuildCancelled())
                return
            self._queue.push(build.client, build)
            if len(self._threads) < self.workers:  # started with the first builds: most servers never build
                thread = threading.Thread(target=self._work, name=f"structured-build-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()

    def cancel(self, build: Build) -> None:
        """Stop `build`: killed if it runs, skipped if it waits."""
        with self._cond:
            build.cancelled = True
            if build.proc is not None:
                build.proc.kill()

    def close(self) -> None:
        """Kill the running builds and refuse the waiting ones (the server is stopping)."""
        with self._cond:
            self._closed = True
            for build in self._running:
                build.cancelled = True
                if build.proc is not None:
                    build.proc.kill()
            waiting = self._queue.drain()
            self._cond.notify_all()
        for build in waiting:
            build.future.set_exception(BuildCancelled())

    def _next(self) -> Build | None:
        """The first waiting build of the client whose turn it is (round robin), or None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                while self._queue:
                    build = self._queue.pop()
                    if build.cancelled:
                        build.future.set_exception(BuildCancelled())
                        continue
                    self._running.add(build)
                    return build
                self._cond.wait()

    def _work(self) -> None:
        while (build := self._next()) is not None:
            try:
                outcome = self._run(build)
            except BaseException as e:
                outcome = e
            with self._cond:
                self._running.discard(build)
            try:
                build.future.set_result(self.done(build, outcome))
            except BaseException as e:
                build.future.set_exception(e)

    def _run(self, build: Build) -> dict:
        with self._cond:
            if build.cancelled:
                raise BuildCancelled()
            build.proc = subprocess.Popen([sys.executable, "-m", "blockdiff.structured.index", str(self.memory),
                                           str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE,
                                          env={**os.environ, **_CHILD_ENV, "PYTHONPATH": os.pathsep.join(sys.path)})
        proc = build.proc
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(build.job, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise InvalidParam("structured_outputs", f"the constraint's automaton took longer than {self.timeout:g} s "
                                                     "to build for this vocabulary (--structured-outputs-timeout): "
                                                     "simplify the schema") from None
        finally:
            if proc.poll() is None:  # an exception in this thread: leave no process behind
                proc.kill()
                proc.wait()
        if build.cancelled:
            raise BuildCancelled()
        if proc.returncode != 0:
            raise InvalidParam("structured_outputs", self._reason(proc.returncode, err))
        arrays = pickle.loads(out)
        log.info("structured output %s: built in %.2f s", build.key, time.monotonic() - t0)
        return arrays

    def _reason(self, returncode: int, err: bytes) -> str:
        lines = err.decode(errors="replace").strip().splitlines()
        last = lines[-1] if lines else ""
        # Past RLIMIT_AS numpy raises MemoryError, and Rust code (outlines-core) aborts on a failed allocation.
        if last.startswith("MemoryError") or returncode < 0 or "memory allocation" in last:
            return (f"the constraint's automaton needs more than {self.memory / 2**30:g} GiB to build "
                    "(--structured-outputs-memory): simplify the schema")
        if last.startswith("Refused: "):
            return "the constraint cannot be served: " + last.removeprefix("Refused: ")
        return f"the constraint cannot be built: {last or 'exit ' + str(returncode)}"
