"""The process supervisor that the tensor-parallel ranks and the data-parallel replicas are started
and stopped by (blockdiff/parallel/processes.py): the stop ladder, and children ending with their
parent's process."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import wait_until

from blockdiff.parallel import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.Popen:
    """A child that prints "ready" once it has set itself up."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)


def _ready(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    assert line, f"the child exited before it was ready (status {proc.wait()})"
    return line


def test_a_child_that_exits_on_its_own_within_the_grace_is_not_signalled():
    proc = _python("import time; print('ready', flush=True); time.sleep(0.3)")
    _ready(proc)
    processes.stop([proc], grace=30)
    assert proc.returncode == 0


def test_a_child_that_ignores_sigterm_is_sigkilled_after_the_wait(monkeypatch):
    monkeypatch.setattr(processes, "TERM_WAIT_S", 0.5)
    proc = _python("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print('ready', flush=True)
        time.sleep(60)
    """)
    _ready(proc)
    t0 = time.monotonic()
    processes.stop([proc], grace=0.2)
    took = time.monotonic() - t0
    assert proc.returncode == -signal.SIGKILL
    assert 0.6 <= took < 10, took


def test_a_stopped_child_acts_on_sigterm():
    """SIGCONT goes with SIGTERM: a stopped process keeps SIGTERM pending until it runs again, so
    without it the ladder would wait for SIGKILL."""
    proc = _python("import time; print('ready', flush=True); time.sleep(60)")
    _ready(proc)
    os.kill(proc.pid, signal.SIGSTOP)
    processes.stop([proc])
    assert proc.returncode == -signal.SIGTERM


# A parent that spawns a child (processes.spawn) which never reads its socket again, so that only the
# parent-death handling can end it; the parent prints the child's pid and waits to be killed.
_PARENT = """
import sys, threading, time
from blockdiff.parallel import processes

def start():
    global child
    child = processes.spawn("test_processes:" + sys.argv[2])
    assert child.sock.recv(2) == b"up"

if sys.argv[1] == "main":
    start()
else:  # from a thread that ends at once: PR_SET_PDEATHSIG would fire with it, so only polling is set
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
print(child.pid, flush=True)
time.sleep(600)
"""


def _sleeper(fd: int) -> None:
    """A child: says it is up, then sleeps; the thread polling the parent can run."""
    import socket

    socket.socket(fileno=fd).sendall(b"up")
    time.sleep(600)


def _spinner(fd: int) -> None:
    """A child: says it is up, then holds the GIL (a backtracking regex never lets go of it), as a
    call into C may: the thread polling the parent never runs, only PR_SET_PDEATHSIG can end it."""
    import re
    import socket

    socket.socket(fileno=fd).sendall(b"up")
    re.match(r"(a+)+$", "a" * 60 + "b")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("started_from, entry", [("main", "_spinner"), ("thread", "_sleeper")])
def test_a_child_exits_when_its_parent_is_killed(started_from, entry):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), ROOT]))
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, started_from, entry], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = parent.stdout.readline().strip()
        assert line, f"the parent exited before its child was up (status {parent.wait()})"
        child = int(line)
        assert _alive(child)
        time.sleep(2 * processes.PARENT_POLL_S)
        assert _alive(child), "the child did not outlive the thread that started it"
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not _alive(child), 5), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, NameError, UnboundLocalError):
            pass
