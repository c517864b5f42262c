"""The processes of a tensor-parallel group: this process is rank 0, ranks 1..N-1 are started.

`RankProcesses.run(fn, *args)` sends `fn` and its arguments to every worker and runs
`fn(context, *args)` on all ranks at once, rank 0 included; their collectives meet in the group.
Socket pairs, not collectives, carry these control messages: an idle worker waits on its socket
with no timeout, a socket reports at once when the other end is gone, and the small CPU tensors of
a step pickle through numpy in microseconds.

Workers are fresh interpreters started by processes.py (`python -c`, this process's sys.path), not
with multiprocessing: the caller's main module is never re-imported (no `__main__` guard needed)
and no multiprocessing helper process (the resource tracker) outlives the group.

Nothing is left running and nobody waits forever:
- a worker that raises sends its traceback and exits; a worker that dies shows in its sentinel
  (a pipe whose write end only the worker holds) and, under gloo, as a failed collective on
  rank 0. Rank 0 then raises `WorkerError` naming the rank, stops every worker, and the group is
  closed. On CUDA a watchdog aborts the
  NCCL communicator when a worker dies, since NCCL would otherwise wait for it forever.
- workers exit when rank 0's process dies: end of file on the socket, and processes.py's parent
  death handling (a thread that polls the parent's pid, for a worker blocked in a collective, and
  PR_SET_PDEATHSIG where the parent started them from its main thread).
- a worker that is alive but stuck (SIGSTOP, a hang) fails rank 0's collective after
  `step_timeout`, and a gathered reply after `run(..., timeout=)`; `ping()` checks an idle group.
  After any failure the group is closed for good: a caller that wants to go on starts a new one.
- `close()`, garbage collection of the `RankProcesses` and interpreter exit stop the workers:
  a stop message, then processes.stop (SIGTERM with SIGCONT, so a stopped worker acts on it, then
  SIGKILL); after a failure, without waiting for the stop message to be read.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing.connection as mpc
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from blockdiff.parallel import processes
from blockdiff.parallel.group import TPGroup, connect

_STOP = b""
_JOIN_S = 5.0  # a stopped worker's time to exit before SIGTERM; and for its exit status once its sentinel shows its end
_FAILURE_WAIT_S = 5.0  # after a failed collective, how long to wait for the worker that caused it


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the message names its rank."""


class WorkerLost(WorkerError):
    """The tensor-parallel group failed and is closed; a new one must be started to go on."""


@dataclass
class RankContext:
    """What a function run on a rank receives: who it is, its device and group, and a place to keep
    state between calls (the model, the runner)."""

    rank: int
    size: int
    device: torch.device
    group: TPGroup
    state: dict = field(default_factory=dict)


def rank_device(device: torch.device | str, rank: int, size: int) -> torch.device:
    """Rank r of a group on CUDA uses the r-th GPU counted from the given one."""
    device = torch.device(device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, not {device.type!r}")
    first = device.index or 0
    available = torch.cuda.device_count()
    if first + size > available:
        raise ValueError(
            f"tensor_parallel_size={size} from cuda:{first} needs {first + size} GPUs, but {available} are visible"
        )
    return torch.device("cuda", first + rank)


class _Worker:
    """Rank 0's handle on one worker: its process, its control socket, and its sentinel."""

    def __init__(self, rank: int, bootstrap: tuple, extra_env: dict[str, str]):
        child = processes.spawn("blockdiff.parallel.ranks:_worker_main", extra_env, sentinel=True)
        self.proc = child.proc
        self.rank = rank
        self.conn = mpc.Connection(child.sock.detach())
        self.sentinel = child.sentinel
        self.conn.send_bytes(_dumps(bootstrap))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        if not mpc.wait([self.sentinel], timeout=0):
            return False
        self.join(_JOIN_S)  # the sentinel closes a moment before the exit status is there to read
        return True

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def death(self) -> str:
        self.join(_JOIN_S)
        code = self.proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
        return f"tensor-parallel rank {self.rank} (pid {self.pid}) {how}"

    def close(self) -> None:
        self.conn.close()
        os.close(self.sentinel)


class RankProcesses:
    def __init__(self, size: int, device: torch.device | str, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                 step_timeout: datetime.timedelta | None = None, env: dict[str, str] | None = None):
        """Start ranks 1..size-1 and join the group as rank 0. `timeout` bounds the group's start-up
        and, unless `step_timeout` is given, rank 0's collectives waiting for a rank that is alive but
        stuck; dead ranks are noticed at once. `env`: variables the workers get on top of this
        process's environment (which is left as it is)."""
        if size < 2:
            raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {size}")
        devices = [rank_device(device, r, size) for r in range(size)]
        self.size = size
        self._closed = False
        self._aborted_by: str | None = None  # set by the CUDA watchdog
        self._failure: str | None = None  # why the group was closed, if it failed
        self._reports: dict[int, tuple[float, str]] = {}  # rank -> (time, traceback) of its failure
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        self._workers: list[_Worker] = []
        self._group_box: list[TPGroup] = []  # rank 0's group, once joined, for the finalizer
        self._abort = [False]  # whether close() follows a failure: abort the group, not shut it down
        self._finalizer = weakref.finalize(self, _stop, self._workers, self._group_box, self._abort)
        try:
            for rank in range(1, size):
                bootstrap = (rank, size, store.port, devices[rank], timeout)
                self._workers.append(_Worker(rank, bootstrap, env or {}))
            for rank in range(1, size):
                self._reply(rank)  # started: imported, on its device, about to join the group
            if devices[0].type == "cuda":
                torch.cuda.set_device(devices[0])
            group = self._while_workers_live(lambda: _connect_rank0(size, store, devices[0], timeout))
        except BaseException:
            self.close(abort=True)
            raise
        self._store = store  # NCCL may still read it when it builds communicators
        self._group_box.append(group)
        if step_timeout is not None:
            group.backend._set_default_timeout(step_timeout)
        self.context = RankContext(0, size, devices[0], group)
        if devices[0].type == "cuda":
            sentinels = [w.sentinel for w in self._workers]
            threading.Thread(target=_abort_on_death, args=(weakref.ref(self), sentinels), daemon=True).start()

    @property
    def closed(self) -> bool:
        """Whether the group was closed (by close(), or for good after a failure)."""
        return self._closed

    def run(self, fn: Callable, *args, gather: bool = False, timeout: float | None = None):
        """fn(context, *args) on every rank; -> rank 0's result, or every rank's with `gather`, each
        awaited for at most `timeout` seconds. `fn` must be importable by name from a module (the
        workers do not run `__main__`)."""
        if getattr(fn, "__module__", None) == "__main__":
            raise ValueError(f"{fn.__qualname__} is defined in __main__, which the workers do not run: move it to a module")
        if self._closed:
            raise WorkerError(f"the tensor-parallel group is closed{' after: ' + self._failure if self._failure else ''}")
        self._raise_failures()
        message = _dumps((fn, args, gather))
        try:
            for w in self._workers:
                try:
                    w.conn.send_bytes(message)
                except OSError as e:
                    raise self._failures(wait=True) or WorkerError(f"tensor-parallel rank {w.rank} is gone: {e}") from e
            mine = fn(self.context, *args)
            if self._aborted_by:
                raise WorkerError(self._aborted_by)
            if not gather:
                return mine
            deadline = None if timeout is None else time.monotonic() + timeout
            return [mine] + [self._reply(rank, deadline) for rank in range(1, self.size)]
        except WorkerError as e:
            self._fail(e)
            raise
        except BaseException as e:
            # A collective that failed on rank 0 is the symptom; the cause is a worker.
            failure = self._failures(wait=True) if isinstance(e, RuntimeError) else None
            self._fail(failure or e)
            if failure is not None:
                raise failure from e
            raise

    def ping(self, timeout: float) -> None:
        """Raise WorkerError unless every worker answers within `timeout` seconds (for an idle group:
        a stopped worker blocks no collective then, so only a message round trip shows it)."""
        self.run(_alive, gather=True, timeout=timeout)

    def close(self, abort: bool = False) -> None:
        """Stop every worker (idempotent). `abort`: after a failure, when the group may be mid-collective."""
        self._closed = True
        self._abort[0] = self._abort[0] or abort
        self._finalizer()

    def __enter__(self) -> "RankProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- failures -----------------------------------------------------------------------------
    def _reply(self, rank: int, deadline: float | None = None):
        w = self._workers[rank - 1]
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not mpc.wait([w.conn, w.sentinel], timeout=wait):
            raise WorkerError(f"tensor-parallel rank {rank} did not answer in time (hung or stopped)")
        message = self._receive(rank)
        if message is None or message[0] == "error":
            raise self._failures(wait=True) or WorkerError(w.death())
        return message[1]

    def _receive(self, rank: int) -> tuple | None:
        """The next message from a worker, if one is there; an error report stays kept for _failures."""
        if rank in self._reports:
            return "error", self._reports[rank]
        conn = self._workers[rank - 1].conn
        try:
            if not conn.poll():
                return None
            kind, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        if kind == "error":
            self._reports[rank] = value
        return kind, value

    def _raise_failures(self) -> None:
        failure = self._failures(wait=False)
        if failure is not None:
            self._fail(failure)
            raise failure

    def _fail(self, error: BaseException) -> None:
        self._failure = self._failure or f"{type(error).__name__}: {error}"
        self.close(abort=True)

    def _failures(self, wait: bool) -> WorkerError | None:
        """What went wrong on the workers: ranks that died unannounced first (the likely cause),
        then ranks that reported an error. With `wait`, give a failing worker time to show it."""
        if wait:
            mpc.wait([w.conn for w in self._workers] + [w.sentinel for w in self._workers], timeout=_FAILURE_WAIT_S)
            time.sleep(0.1)  # a worker that failed because of another one reports right after it
        died, reported = [], []
        for w in self._workers:
            message = self._receive(w.rank)
            if message is not None and message[0] == "error":
                when, text = message[1]
                reported.append((when, f"tensor-parallel rank {w.rank} failed:\n{text}"))
            elif w.exited():
                died.append(w.death())
        if not died and not reported:
            return None
        # The first to fail is the cause; the others failed in a collective with it.
        return WorkerError("\n".join(died + [text for _, text in sorted(reported)]))

    def _while_workers_live(self, fn: Callable):
        """fn() in a helper thread, returning early with WorkerError if a worker dies meanwhile."""
        box: list = []

        def call():
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller below
                box.append((False, e))

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive():
                self._raise_failures()
        ok, value = box[0]
        if not ok:
            raise value
        return value


def _abort_on_death(ranks: weakref.ref, sentinels: list) -> None:
    """CUDA only: NCCL waits for a dead peer forever, so abort the communicator when a worker dies;
    rank 0's step then returns or fails, and run() raises WorkerError naming the rank."""
    rank = sentinels.index(mpc.wait(sentinels)[0]) + 1
    owner = ranks()
    if owner is None or owner._closed:
        return
    owner._aborted_by = owner._workers[rank - 1].death()
    owner.context.group.backend.abort()


def _connect_rank0(size: int, store: dist.Store, device: torch.device, timeout: datetime.timedelta) -> TPGroup:
    if device.type != "cuda":
        return connect(0, size, store, device, timeout)
    # Rank 0 is the user's process: on a failed collective NCCL should clean up, not kill it.
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    before = os.environ.get(key)
    os.environ.setdefault(key, "2")
    try:
        return connect(0, size, store, device, timeout)
    finally:
        if before is None:
            del os.environ[key]


def _stop(workers: list[_Worker], group_box: list, abort: list) -> None:
    for w in workers:
        try:
            w.conn.send_bytes(_STOP)
        except OSError:
            pass
    if abort[0]:
        # After a failure a worker may be stuck in a collective and never read the message; and
        # aborting gloo's group waits for a collective that rank 0's step thread may still be in,
        # which ends once the workers are gone.
        processes.stop([w.proc for w in workers])
        for group in group_box:
            group.shutdown(abort=True)
    else:
        for group in group_box:
            group.shutdown()
        processes.stop([w.proc for w in workers], grace=_JOIN_S)
    for w in workers:
        w.close()
    workers.clear()


def _alive(ctx: RankContext) -> None:
    """ping()'s message: answering it is the proof of life."""


# ---- the wire ------------------------------------------------------------------------------------
class _Pickler(pickle.Pickler):
    """CPU tensors travel as numpy arrays: torch's own pickling of a tensor costs ~100x more."""

    def reducer_override(self, obj):
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.dtype in _NUMPY_DTYPES and not obj.requires_grad:
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def message_bytes(fn: Callable, *args) -> int:
    """The size of the message `run(fn, *args)` sends to each worker."""
    return len(_dumps((fn, args, False)))


# ---- the worker side -----------------------------------------------------------------------------
def _worker_main(fd: int) -> None:
    """A worker (processes.spawn): fd is its end of the socket pair."""
    conn = mpc.Connection(fd)
    rank, size, port, device, timeout = pickle.loads(conn.recv_bytes())
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send_bytes(_dumps(("started", None)))
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
        context = RankContext(rank, size, device, connect(rank, size, store, device, timeout))
    except BaseException:
        _fail(conn)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # rank 0's process is gone
            os._exit(1)
        if message == _STOP:
            break
        try:
            fn, args, gather = pickle.loads(message)
            result = fn(context, *args)
            if gather:
                conn.send_bytes(_dumps(("ok", result)))
        except BaseException:
            _fail(conn)
    context.group.shutdown()
    conn.close()
    processes.exit_now(0)


def _fail(conn) -> None:
    """Report the exception being handled to rank 0 and exit now: the group is no longer in step,
    and a normal interpreter exit could wait on it."""
    text = traceback.format_exc()
    try:
        conn.send_bytes(_dumps(("error", (time.time(), text))))
    except OSError:
        pass
    sys.stderr.write(text)
    sys.stderr.flush()
    os._exit(1)
