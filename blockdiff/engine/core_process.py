"""One engine replica in a process of its own: the engine core that the data-parallel front end
(dp_client.py) routes requests to.

The front end starts it with parallel/processes.py, as parallel/ranks.py starts the tensor-parallel
workers (a fresh interpreter with one end of a socket pair, which exits when the front end's
process does), and sends it a `Bootstrap`. The replica builds its engine (its own tensor-parallel group, if
any, is started under it), answers with a `Handshake` and serves the front end's messages until it
is stopped or the front end goes away. An `AsyncEngine` drives the engine inside: a lost
tensor-parallel worker is restarted within the replica, as in a server of one engine, and only a
replica whose workers cannot be restarted exits, for the front end to start anew.

Messages are pickled tuples in frames (a 4-byte big-endian length, then the bytes); the socket pair
carries nothing else, between processes of the same user on one machine.

    front end -> replica
      ("add", call, requests)          queue an API call's requests (EngineRequests, AsyncEngine.add)
      ("abort", call)                  end what is left of a call; nothing more is sent of it
      ("drain", grace)                 take no more requests; those in flight get `grace` seconds
      ("stop",)                        abort everything, shut the engine down and exit
    replica -> front end
      ("ready", Handshake) | ("failed", error)    once, when the engine is built or could not be
      ("added", call) | ("refused", call, error)  whether a call's requests were queued
      ("out", call, index, RequestOutput)         each output, in the order the engine makes them
      ("done", call) | ("error", call, error)     how a call ended
      ("kv", events)                              a step's KV events (kv_events.py), sent before
                                                  that step's outputs
      ("step", seconds, EngineStats)              after every engine step
      ("finish", reason, prompt_tokens, generated_tokens, metrics)   AsyncEngine's on_finish
      ("state", available, reason, EngineStats)   every STATE_S

End of file on the socket is how either side learns that the other is gone: the replica then shuts
its engine down and exits, the front end fails the replica's requests and starts it again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from blockdiff.config import EngineConfig
from blockdiff.engine.async_engine import AsyncEngine, EngineUnavailable, QueueFull, RequestFailed, StreamOverflow
from blockdiff.engine.client import EngineLimits, EngineStats, structured_specs
from blockdiff.inputs import EngineRequest
from blockdiff.multimodal import MediaError
from blockdiff.multimodal.image import ImageError
from blockdiff.multimodal.video import VideoError
from blockdiff.parallel import processes
from blockdiff.sampling_params import InvalidParam

log = logging.getLogger(__name__)

STATE_S = 0.25  # how often a replica reports its state and stats
ENTRY = "blockdiff.engine.core_process:main"  # what processes.spawn runs in a replica's process
_HEADER = struct.Struct(">I")


@dataclass
class Bootstrap:
    cfg: EngineConfig  # this replica's: its data_parallel_rank and device set
    start: Callable  # EngineConfig -> LLMEngine, by reference (startup.start_engine)
    max_queued_requests: int | None
    log_level: int


@dataclass
class Handshake:
    """What the front end needs of a replica to serve without asking it: the limits and the sampler
    defaults to resolve requests by, and its cache."""

    pid: int
    limits: EngineLimits
    sampler: str
    defaults: dict
    eos_token_ids: tuple[int, ...]
    cache_tokens: int
    stats: EngineStats

    @classmethod
    def of(cls, engine) -> Handshake:
        """An LLMEngine's."""
        inputs = engine.inputs
        return cls(os.getpid(), engine.limits, engine.sampler.name, inputs.defaults, inputs.eos_token_ids,
                   inputs.cache_tokens, engine.stats())


# ---- frames ----------------------------------------------------------------------------------------
def encode_frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, obj) -> None:
    sock.sendall(encode_frame(obj))


def recv_frame(sock: socket.socket):
    """The next message (blocking); EOFError once the other side is gone."""
    (n,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the other end of the socket is gone")
        buf += chunk
    return bytes(buf)


async def read_frame(reader: asyncio.StreamReader):
    """The next message; asyncio.IncompleteReadError once the other side is gone."""
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(n))


# ---- errors over the wire ------------------------------------------------------------------------
_ERRORS = {cls.__name__: cls for cls in (EngineUnavailable, QueueFull, RequestFailed, StreamOverflow, MediaError,
                                          ImageError, VideoError)}


def wire_error(e: BaseException) -> tuple[str, str, str | None]:
    """An exception as (kind, message, field): what `error_of` rebuilds on the other side."""
    if isinstance(e, InvalidParam):
        return "InvalidParam", str(e), e.field
    kind = type(e).__name__
    if kind not in _ERRORS:
        kind = "ValueError" if isinstance(e, ValueError) else "RuntimeError"
    return kind, str(e), None


def error_of(wire: tuple[str, str, str | None]) -> Exception:
    kind, message, field = wire
    if kind == "InvalidParam":
        return InvalidParam(field, message)
    return _ERRORS.get(kind, ValueError if kind == "ValueError" else RuntimeError)(message)


# ---- the replica ---------------------------------------------------------------------------------
class _Replica:
    def __init__(self, client: AsyncEngine, sock: socket.socket):
        self.client, self.sock = client, sock
        self.calls: dict[int, asyncio.Task] = {}
        self.writer: asyncio.StreamWriter | None = None

    def send(self, message: tuple) -> None:
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(encode_frame(message))

    async def serve(self) -> int:
        """Serve the front end until it stops us (-> 0) or goes away (-> 0), or the engine fails for
        good (-> 1: the front end starts a new replica)."""
        loop = asyncio.get_running_loop()
        reader, self.writer = await asyncio.open_connection(sock=self.sock)
        client = self.client
        client.on_step = lambda seconds, engine: self.send(("step", seconds, client.engine.stats()))
        client.on_finish = lambda reason, prompt_tokens, generated_tokens, metrics, engine: self.send(
            ("finish", reason, prompt_tokens, generated_tokens, metrics))
        # From the engine's thread, at the end of a step: queued on the loop before the step's outputs.
        client.engine.kv_event_sinks.append(lambda events: loop.call_soon_threadsafe(self.send, ("kv", events)))
        client.start()
        reading = loop.create_task(self._read(reader))
        watch = loop.create_task(self._watch())
        done, _ = await asyncio.wait({reading, watch}, return_when=asyncio.FIRST_COMPLETED)
        if reading in done:
            watch.cancel()
            return reading.result()
        reading.cancel()  # the engine failed for good
        client.shutdown()
        return 1

    async def _read(self, reader: asyncio.StreamReader) -> int:
        loop = asyncio.get_running_loop()
        client = self.client
        while True:
            try:
                kind, *args = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):  # the front end is gone
                client.shutdown()
                return 0
            if kind == "add":
                self.calls[args[0]] = loop.create_task(self._serve_call(*args))
            elif kind == "abort":
                task = self.calls.pop(args[0], None)
                if task is not None:
                    task.cancel()
            elif kind == "drain":
                client.drain_threadsafe(args[0])
            elif kind == "stop":
                await client.stop()
                return 0

    async def _watch(self) -> None:
        """Report the state every STATE_S; return once the engine has failed for good."""
        while not self.client.dead:
            client = self.client
            self.send(("state", client.available, client.unavailable_reason(), client.engine.stats()))
            await asyncio.sleep(STATE_S)
        log.error("the engine of this replica could not be restarted; the replica exits")

    async def _serve_call(self, call: int, requests: list[EngineRequest]) -> None:
        stream = None
        try:
            try:
                # A new structured output's automaton is built off this replica's loop first.
                for spec in structured_specs(requests):
                    await self.client.prepare(spec, requests[0].client)
                stream = await self.client.add(requests)
            except Exception as e:
                self.send(("refused", call, wire_error(e)))
                return
            self.send(("added", call))
            async for index, out in stream:
                self.send(("out", call, index, out))
            self.send(("done", call))
        except asyncio.CancelledError:  # the front end aborted the call
            if stream is not None:
                stream.abort()
            raise
        except Exception as e:
            self.send(("error", call, wire_error(e)))
        finally:
            self.calls.pop(call, None)


def main(fd: int) -> None:
    """The replica process (processes.spawn(ENTRY)): fd is its end of the socket pair."""
    sock = socket.socket(fileno=fd)
    boot: Bootstrap = recv_frame(sock)
    rank = boot.cfg.replica
    logging.basicConfig(level=boot.log_level,
                        format=f"%(asctime)s %(levelname)s replica {rank} %(name)s: %(message)s")
    try:
        engine = boot.start(boot.cfg)
    except BaseException as e:
        log.debug("the engine could not be built", exc_info=True)
        send_frame(sock, ("failed", wire_error(e)))
        processes.exit_now(1)
    client = AsyncEngine(engine, boot.max_queued_requests)
    try:
        send_frame(sock, ("ready", Handshake.of(engine)))
        code = asyncio.run(_Replica(client, sock).serve())
    except (EOFError, OSError):  # the front end went away before we could begin
        client.shutdown()
        code = 0
    processes.exit_now(code)
