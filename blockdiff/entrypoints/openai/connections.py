"""Connection hygiene under uvicorn: no connection holds a file descriptor for nothing.

uvicorn's h11 protocol arms its keep-alive timer only after a response, so a connection that never
sends a byte is kept forever; a thousand of them exhaust the descriptors and nobody, /health
included, gets a connection. `guarded_protocol` adds:
- a header timeout: a connection must start a request within `header_timeout` seconds of opening
  (and of its previous response), or it is closed;
- room for new connections: past `max_connections`, the connection idle for longest (no request
  in progress: silent, between requests, or still sending headers) is closed to make room. If
  every connection is busy, uvicorn's `limit_concurrency` answers the new one's request with 503.
A burst can still run out of descriptors: asyncio accepts up to `backlog` connections in one go
before any of them can make room (a small backlog avoids that, but makes connecting clients wait
for SYN retries: 2,000 connections took 60 s instead of 10 at a backlog of 32). asyncio then
pauses accepting for a second, and `AcceptErrorLog` keeps it from logging a traceback each time.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

FDS_KEPT = 256  # descriptors kept for everything but client connections (logs, model files, workers)


def connection_limit(configured: int) -> int:
    """At most `configured` connections, and never more than the descriptor limit leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft - FDS_KEPT))


class GuardedH11Protocol(H11Protocol):
    header_timeout: float
    max_connections: int

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._make_room()
        self._await_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    @property
    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _await_request(self) -> None:
        """Start the header timer: it closes the connection unless a request starts before it ends."""
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._idle_since = time.monotonic()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout, self.scope)

    def _header_timeout(self, scope_when_armed) -> None:
        if self.scope is scope_when_armed and not self.transport.is_closing():  # no new request began
            self.transport.close()

    def _make_room(self) -> None:
        if len(self.connections) <= self.max_connections:
            return
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c._idle
                and not c.transport.is_closing()]
        if idle:
            min(idle, key=lambda c: c._idle_since).transport.close()


def guarded_protocol(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...), with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})


class AcceptErrorLog:
    """An event loop exception handler: out-of-descriptor errors (asyncio retries accept() every
    second, logging a traceback each time) become one line per `every` seconds with a count."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self._last = -float("inf")
        self._suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self._last < self.every:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more like it since the last report)" if self._suppressed else ""
        log.error("%s: %s; new connections wait until descriptors free up%s", context.get("message"), exc, more)
        self._last, self._suppressed = now, 0
