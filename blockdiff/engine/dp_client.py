"""The front end of data parallelism: the remote engine client (remote_client.py) over processes,
`data_parallel_size` engine replicas each in a process of its own (core_process.py) with its own
tensor-parallel group and devices, replica r on GPUs r x TP ... r x TP + TP - 1 (on the CPU,
processes sharing the cores).

Each engine request goes to the replica `ReplicaRouting` chooses (prefix_router.py, the routing of
Ray Serve's router too): the one whose KV events (sent by the replica's process before its step's
outputs) say it caches the longest prefix of the request's blocks, else the least loaded; the
requests of one API call may go to several replicas, and their outputs come back as one stream.

A replica that dies (its socket closes) fails only the requests it was running, with
EngineUnavailable ("retry"), and is started again, at most RESTART_TRIES times in a row, while the
others serve; the front end is dead only when every replica is. /metrics reads each replica's stats
as it reports them after every step and every STATE_S (core_process.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from blockdiff.config import EngineConfig
from blockdiff.engine.async_engine import RESTART_TRIES, EngineUnavailable, RequestStream
from blockdiff.engine.client import EngineStats
from blockdiff.engine.core_process import ENTRY, Bootstrap, Handshake, encode_frame, error_of, read_frame, recv_frame, send_frame
from blockdiff.engine.kv_events import hashed
from blockdiff.engine.prefix_router import ReplicaRouting, default_imbalance, prompt_block_keys
from blockdiff.engine.remote_client import RemoteClient
from blockdiff.inputs import EngineRequest
from blockdiff.parallel import processes

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # after ("stop",), how long a replica may take to exit before it is killed
_KILL_WAIT_S = 5.0


def replica_device(cfg: EngineConfig, rank: int) -> str:
    """Replica r's first device: the r-th group of tensor_parallel_size GPUs from the given one."""
    device = cfg.resolved_device()
    if device == "cpu":
        return device
    first = torch.device(device).index or 0
    needed = first + cfg.data_parallel_size * cfg.tensor_parallel_size
    if needed > torch.cuda.device_count():
        raise ValueError(f"data_parallel_size={cfg.data_parallel_size} x tensor_parallel_size={cfg.tensor_parallel_size} "
                         f"from cuda:{first} needs {needed} GPUs, but {torch.cuda.device_count()} are visible")
    return f"cuda:{first + rank * cfg.tensor_parallel_size}"


class _Call:
    """The requests of one API call that went to one replica: `rids[i]` is the i-th of them."""

    def __init__(self, stream: RequestStream, rids: list[str], keys: list[tuple]):
        self.stream, self.rids, self.keys = stream, rids, keys
        self.added = asyncio.get_running_loop().create_future()
        self.open = set(range(len(rids)))  # those that have not finished


class _Replica:
    """The front end's handle on one replica process."""

    def __init__(self, rank: int):
        self.rank = rank
        self.name = str(rank)
        self.device = ""  # its first device
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reader: asyncio.StreamReader | None = None
        self.state = "starting"  # up, restarting, dead
        self.core_available = True  # its engine takes requests (not draining, not restarting its workers)
        self.core_reason = ""
        self.stats: EngineStats | None = None
        self.calls: dict[int, _Call] = {}
        self.in_flight = 0  # engine requests routed here that have not ended

    @property
    def up(self) -> bool:
        return self.state == "up" and self.core_available

    def send(self, message: tuple) -> None:
        if self.writer is None or self.writer.is_closing():
            raise EngineUnavailable(f"replica {self.rank} is not running")
        self.writer.write(encode_frame(message))


class DPClient(RemoteClient):
    """The process transport of the remote client: starts the replicas (and waits until every one has built its engine) when constructed;
    `start()` then serves on the running loop. `start_engine` builds a replica's engine in its own
    process (startup.start_engine, passed by reference); `env`: variables the replicas get on top of
    this process's environment."""

    def __init__(self, cfg: EngineConfig, start_engine: Callable, max_queued_requests: int | None = None,
                 env: dict[str, str] | None = None):
        self.cfg = cfg
        self._start_engine = start_engine
        self._max_queued = max_queued_requests
        self._env = env or {}
        self.replicas = [_Replica(r) for r in range(cfg.data_parallel_size)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._where: dict[str, tuple[_Replica, int]] = {}  # request id -> its replica and call
        self._closed = False
        self._stopping = False
        self._tasks: set[asyncio.Task] = set()
        try:
            for rep in self.replicas:
                self._spawn(rep)
            handshakes = [self._ready(rep, recv_frame(rep.sock)) for rep in self.replicas]
        except BaseException:
            self._closed = self._stopping = True
            for rep in self.replicas:
                self._end_process(rep, wait=0)
            raise
        first = handshakes[0]
        for rep, hs in zip(self.replicas, handshakes):
            if (hs.limits, hs.sampler, hs.defaults) != (first.limits, first.sampler, first.defaults):
                self.shutdown()
                raise RuntimeError(f"replica {rep.rank} serves {hs.limits} with {hs.sampler}, replica 0 {first.limits} "
                                   f"with {first.sampler}: the replicas must be alike")
        super().__init__(cfg, first, min(hs.cache_tokens for hs in handshakes))
        self.routing = ReplicaRouting(default_imbalance(self.limits.max_num_seqs))
        log.info("data parallel: %d replicas (pids %s), each %s", len(self.replicas),
                 ", ".join(str(hs.pid) for hs in handshakes),
                 f"on {self.replicas[0].device}" if cfg.tensor_parallel_size == 1 else
                 f"a tensor-parallel group of {cfg.tensor_parallel_size} from {self.replicas[0].device}")

    # ---- the replicas' processes -----------------------------------------------------------------
    def _spawn(self, rep: _Replica) -> None:
        """Start rep's process and send its bootstrap (the handshake comes when its engine is built)."""
        cfg = replace(self.cfg, data_parallel_rank=rep.rank, device=replica_device(self.cfg, rep.rank))
        rep.device = cfg.device
        child = processes.spawn(ENTRY, self._env)
        rep.proc, rep.sock = child.proc, child.sock
        send_frame(rep.sock, Bootstrap(cfg, self._start_engine, self._max_queued, logging.getLogger().getEffectiveLevel()))

    def _ready(self, rep: _Replica, message: tuple) -> Handshake:
        kind, value = message
        if kind == "failed":
            raise type(error := error_of(value))(f"replica {rep.rank}: {error}")
        rep.state, rep.core_available, rep.stats = "up", True, value.stats
        return value

    def _end_process(self, rep: _Replica, wait: float = _KILL_WAIT_S) -> None:
        """Close rep's socket (it exits on end of file) and make sure its process is gone: stopped
        (processes.stop) if it has not exited within `wait` seconds."""
        if rep.writer is not None:
            rep.writer.close()
        elif rep.sock is not None:
            rep.sock.close()
        rep.writer = rep.reader = rep.sock = None
        proc, rep.proc = rep.proc, None
        if proc is not None:
            processes.stop([proc], grace=wait)

    # ---- EngineClient ------------------------------------------------------------------------------
    def engine_stats(self) -> dict[str, EngineStats]:
        return {rep.name: rep.stats for rep in self.replicas if rep.state == "up" and rep.stats is not None}

    @property
    def available(self) -> bool:
        return self._loop is not None and not self._closed and any(rep.up for rep in self.replicas)

    @property
    def dead(self) -> bool:
        return all(rep.state == "dead" for rep in self.replicas)

    def unavailable_reason(self) -> str:
        if self._closed:
            return "the server is shutting down"
        if self.dead:
            return "every engine replica failed and could not be restarted; the server is exiting"
        if self._loop is None:
            return "the engine is not running"
        reasons = {rep.core_reason for rep in self.replicas if rep.state == "up" and rep.core_reason}
        if reasons:
            return "; ".join(sorted(reasons))
        return "no engine replica is running; they are restarting: retry shortly"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for rep in self.replicas:
            self._background(self._connect(rep))

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, rep: _Replica) -> None:
        rep.sock.setblocking(False)
        rep.reader, rep.writer = await asyncio.open_connection(sock=rep.sock)
        await self._read(rep)

    async def add(self, requests: list[EngineRequest]) -> RequestStream:
        if not self.available:
            raise EngineUnavailable(self.unavailable_reason())
        stream = RequestStream(self, [f"req-{next(self._ids)}" for _ in requests])
        groups: dict[_Replica, list[int]] = {}
        keys = []
        for i, request in enumerate(requests):
            keys.append(prompt_block_keys(request, self.block_size, self.prefix_cache_scope)
                        if self.prefix_caching else ())
            rep = self._route(keys[-1])
            groups.setdefault(rep, []).append(i)
        calls = []
        for rep, indices in groups.items():
            call = _Call(stream, [stream.request_ids[i] for i in indices], [keys[i] for i in indices])
            call_id = next(self._call_ids)
            rep.calls[call_id] = call
            for rid in call.rids:
                self._where[rid] = (rep, call_id)
            calls.append(call)
            try:
                rep.send(("add", call_id, [requests[i] for i in indices]))
            except EngineUnavailable as e:
                call.added.set_exception(e)
        try:
            results = await asyncio.gather(*(call.added for call in calls), return_exceptions=True)
        except asyncio.CancelledError:  # the caller went away: take back what was added
            stream.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            stream.abort()
            raise errors[0]
        return stream

    def abort(self, request_ids: list[str]) -> None:
        for rep, call_id in {self._where[rid] for rid in request_ids if rid in self._where}:
            call = rep.calls.get(call_id)
            if call is not None:
                self._end_call(rep, call_id)
                try:
                    rep.send(("abort", call_id))
                except EngineUnavailable:
                    pass

    def drain_threadsafe(self, grace: float) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain, grace)

    def _drain(self, grace: float) -> None:
        self._closed = True
        for rep in self.replicas:
            if rep.state == "up":
                try:
                    rep.send(("drain", grace))
                except EngineUnavailable:
                    pass

    async def stop(self) -> None:
        """Stop every replica (each aborts what it runs and shuts its engine down), then the processes."""
        self._closed = self._stopping = True
        for rep in self.replicas:
            if rep.state == "up":
                try:
                    rep.send(("stop",))
                except EngineUnavailable:
                    pass
        waiting = [rep.proc for rep in self.replicas if rep.proc is not None]
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, _wait, proc, STOP_WAIT_S) for proc in waiting))
        self.shutdown()

    def shutdown(self) -> None:
        self._closed = self._stopping = True
        for rep in self.replicas:
            for call_id in list(rep.calls):
                self._fail_call(rep, call_id, EngineUnavailable("the server is shutting down"))
            self._end_process(rep)

    # ---- routing -----------------------------------------------------------------------------------
    def _route(self, keys: Sequence) -> _Replica:
        up = [rep for rep in self.replicas if rep.up]
        if not up:
            raise EngineUnavailable(self.unavailable_reason())
        rep = self.routing.choose([(rep, rep.in_flight, rep.stats.kv_cache_free_blocks if rep.stats else 0)
                                   for rep in up], keys)
        rep.in_flight += 1
        self.routing.routed(rep, keys)
        return rep

    # ---- messages from a replica ---------------------------------------------------------------------
    async def _read(self, rep: _Replica) -> None:
        try:
            while True:
                self._handle(rep, await read_frame(rep.reader))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        if not self._stopping:
            self._lost(rep)

    def _handle(self, rep: _Replica, message: tuple) -> None:
        kind, *args = message
        if kind == "out":
            call_id, index, out = args
            call = rep.calls.get(call_id)
            if call is None:  # aborted meanwhile
                return
            out.request_id = call.rids[index]
            if out.finished and index in call.open:
                call.open.discard(index)
                self._request_ended(rep, call.keys[index])
            call.stream._put(out)
        elif kind == "kv":
            self.routing.events(rep, hashed(args[0]))
        elif kind == "step":
            seconds, rep.stats = args
            self.on_step(seconds, rep.name)
        elif kind == "state":
            rep.core_available, rep.core_reason, rep.stats = args
            if rep.core_available:
                rep.core_reason = ""
        elif kind == "finish":
            self.on_finish(*args, engine=rep.name)
        elif kind == "added":
            call = rep.calls.get(args[0])
            if call is not None and not call.added.done():
                call.added.set_result(None)
        elif kind == "refused":
            call = rep.calls.get(args[0])
            if call is not None:
                self._end_call(rep, args[0])
                if not call.added.done():
                    call.added.set_exception(error_of(args[1]))
        elif kind == "done":
            if args[0] in rep.calls:
                self._end_call(rep, args[0])
        elif kind == "error":
            self._fail_call(rep, args[0], error_of(args[1]))

    def _request_ended(self, rep: _Replica, keys: tuple) -> None:
        rep.in_flight -= 1
        self.routing.ended(rep, keys)

    def _end_call(self, rep: _Replica, call_id: int) -> _Call:
        call = rep.calls.pop(call_id)
        for i in call.open:
            self._request_ended(rep, call.keys[i])
        call.open.clear()
        for rid in call.rids:
            self._where.pop(rid, None)
        return call

    def _fail_call(self, rep: _Replica, call_id: int, error: Exception) -> None:
        if call_id not in rep.calls:
            return
        call = self._end_call(rep, call_id)
        if not call.added.done():
            call.added.set_exception(error)
        else:
            call.stream._put(error)

    def _lost(self, rep: _Replica) -> None:
        """rep's process is gone: fail what it ran, start it again."""
        code = rep.proc.poll() if rep.proc is not None else None
        log.error("replica %d was lost (exit code %s); its %d requests fail, the replica restarts", rep.rank, code,
                  rep.in_flight)
        rep.state = "restarting"
        error = EngineUnavailable(f"engine replica {rep.rank} was lost while this request ran; it is restarting: retry")
        for call_id in list(rep.calls):
            self._fail_call(rep, call_id, error)
        self.routing.forget(rep)
        rep.in_flight = 0
        rep.stats = None
        self._end_process(rep)
        self._background(self._restart(rep))

    async def _restart(self, rep: _Replica) -> None:
        loop = asyncio.get_running_loop()
        for attempt in range(1, RESTART_TRIES + 1):
            if self._stopping:
                return
            try:
                self._spawn(rep)
                rep.sock.setblocking(False)
                rep.reader, rep.writer = await asyncio.open_connection(sock=rep.sock)
                hs = self._ready(rep, await read_frame(rep.reader))
            except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, RuntimeError) as e:
                log.error("replica %d: restart %d of %d failed: %s", rep.rank, attempt, RESTART_TRIES, e or "it exited")
                await loop.run_in_executor(None, self._end_process, rep)
                continue
            log.info("replica %d restarted (try %d, pid %d); serving again", rep.rank, attempt, hs.pid)
            await self._read(rep)
            return
        rep.state = "dead"
        log.error("replica %d could not be restarted; the other replicas go on serving", rep.rank)


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
