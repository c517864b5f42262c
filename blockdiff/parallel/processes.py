"""Child processes that end with their parent and always stop: how the tensor-parallel ranks
(ranks.py) and the data-parallel engine replicas (engine/core_process.py, started by
engine/dp_client.py) are started and stopped, and how a structured-output build
(structured/index.py) ends with the server.

`spawn("module:function")` starts a fresh interpreter (`python -c`, this process's sys.path), not a
multiprocessing one: the caller's main module is never re-imported (no `__main__` guard needed) and
no multiprocessing helper process (the resource tracker) outlives the children. The child gets one
end of a socket pair, the parent keeps the other: end of file tells either side at once that the
other is gone. Ctrl-C in a terminal reaches the whole process group; it is the parent's to handle
(it stops its children), so a child ignores SIGINT from its first line on.

A child ends when its parent's process does (`exit_with_parent`, run before the child's function):
- PR_SET_PDEATHSIG: the kernel SIGKILLs the child when the *thread* that started it ends, not the
  process; so it is set only where the parent started the child from its main thread (or, for a
  build, from a thread that lives as long as the server);
- a thread polling the parent's pid, for a child blocked where end of file on its socket does not
  reach it (a collective, a C call) when PR_SET_PDEATHSIG could not be set.

`stop(procs, grace)`: the caller has sent its own stop message; whatever has not exited within
`grace` gets SIGTERM (with SIGCONT, so that a stopped process acts on it), and whatever outlives
that SIGKILL.

This module imports nothing of blockdiff and nothing that imports torch: a structured-output build
(structured/index.py) imports it without torch.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

PARENT_POLL_S = 0.5
TERM_WAIT_S = 5.0  # after SIGTERM, how long a process has to exit before SIGKILL
_PR_SET_PDEATHSIG = 1

_COMMAND = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "from blockdiff.parallel.processes import _child; _child()")


@dataclass
class Child:
    proc: subprocess.Popen
    sock: socket.socket  # the parent's end of the socket pair
    # With spawn(sentinel=True): the read end of a pipe whose write end only the child holds. It is
    # readable (end of file) only once the child's process has ended, where the socket is readable
    # for every message too: for multiprocessing.connection.wait.
    sentinel: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


def spawn(entry: str, env: dict[str, str] | None = None, sentinel: bool = False) -> Child:
    """Start `function(fd)` of `entry` ("module:function", importable from this process's sys.path)
    in a child process; fd is the child's end of a new socket pair. `env`: variables the child gets
    on top of this process's environment."""
    pdeathsig = threading.current_thread() is threading.main_thread()
    ours, theirs = socket.socketpair()
    readable, held = os.pipe() if sentinel else (None, None)
    fds = (theirs.fileno(),) if held is None else (theirs.fileno(), held)
    command = [sys.executable, "-c", _COMMAND, entry, str(theirs.fileno()), str(os.getpid()), str(int(pdeathsig))]
    try:
        proc = subprocess.Popen(command, pass_fds=fds, env=dict(os.environ, **(env or {}), PYTHONPATH=os.pathsep.join(sys.path)))
    except BaseException:
        ours.close()
        if readable is not None:
            os.close(readable)
        raise
    finally:
        theirs.close()
        if held is not None:
            os.close(held)
    return Child(proc, ours, readable)


def _child() -> None:
    """The child's side of spawn(): argv is the entry, its socket's fd, the parent's pid, and whether
    PR_SET_PDEATHSIG follows the parent."""
    entry, fd, parent_pid, pdeathsig = sys.argv[1:5]
    exit_with_parent(int(parent_pid), pdeathsig == "1")
    module, function = entry.split(":")
    getattr(importlib.import_module(module), function)(int(fd))


def exit_with_parent(parent_pid: int, pdeathsig: bool, poll: bool = True) -> None:
    """End this process (exit status 1) when the parent `parent_pid` ends: by PR_SET_PDEATHSIG with
    `pdeathsig` (Linux), and with `poll` by a thread that polls the parent's pid."""
    if pdeathsig and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was set: nobody waits for us
        os._exit(1)
    if poll:
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="blockdiff-parent-watch", daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def exit_now(code: int) -> None:
    """Exit a child whose work is shut down: tearing down an interpreter that imported torch takes a
    second, and nothing is left to clean up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop(procs: Iterable[subprocess.Popen], grace: float = 0.0) -> None:
    """Make sure every process in `procs` has ended, and reap it: those still running after `grace`
    seconds (together: the time a stop message already sent has to work) get SIGTERM, and those
    still running TERM_WAIT_S later SIGKILL."""
    alive = _wait_all(list(procs), grace)
    for proc in alive:
        proc.terminate()
        proc.send_signal(signal.SIGCONT)  # a stopped process keeps SIGTERM pending until it runs again
    alive = _wait_all(alive, TERM_WAIT_S)
    for proc in alive:
        proc.kill()
    for proc in alive:
        # SIGKILL cannot be ignored, so this ends: it is the kernel freeing the process (a CUDA
        # context's memory can take seconds), which whoever starts the next one needs done.
        proc.wait()


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.Popen]:
    """Wait up to `timeout` seconds, together, for `procs` to exit; -> those still running."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [proc for proc in procs if proc.poll() is None]
