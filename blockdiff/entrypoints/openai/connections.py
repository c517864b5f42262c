"""Connection admission under uvicorn: no client, authenticated or not, can hold what others need.

uvicorn's h11 protocol arms its keep-alive timer only after a response, so a connection that never
sends a byte is kept forever, and its `limit_concurrency` answers every request, /health included,
with a plain-text 503 once enough connections are open, whatever they are doing. Instead:

- `GuardedH11Protocol` closes a connection that starts no request within `header_timeout` seconds
  of opening (and of its previous response), and past `max_connections` closes the connection idle
  for longest (no request in progress: silent, between requests, or still sending headers) to make
  room. Connections are never refused for their number: /health and the requests whose bodies
  have arrived always get in. uvicorn's own refusals (malformed HTTP) are OpenAI-shaped and counted.
  Each request's scope gets `extensions["blockdiff.drop_connection"]`, which a response calls to
  drop its connection at once (a stream whose client left too much of it unread, serving.py).
- `BodyAdmission` reads each request body before the app sees it: JSON only (415), at most
  `max_bytes` (413), at least `min_rate` bytes a second on average once `grace` seconds have passed
  and all of it within `timeout` (408, so a trickle is cut off), and at most `per_client`
  connections of one client (clients.py: its address, or what a trusted proxy says it is), and
  `total` in all, with a body seen to be still arriving (429, 503).
  The refused connection is closed. Requests without a body are not held to any of it.

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
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from blockdiff.entrypoints.openai.clients import client_of
from blockdiff.entrypoints.openai.errors import error_response

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
    on_closed: Callable[[str], None]  # a connection closed with no request to answer, and why
    on_refused: Callable[[int, str], None]  # a request refused before the app, its status and why

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._make_room()
        self._await_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not cycle:  # a request began; its task has not run yet
            self.scope.setdefault("extensions", {})["blockdiff.drop_connection"] = self._drop

    def _drop(self) -> None:
        """Close the connection at once, whatever is still buffered for it (a stream left unread)."""
        self.transport.abort()
        self.on_closed("unread_stream")

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
            self.on_closed("header_timeout")

    def _make_room(self) -> None:
        if len(self.connections) <= self.max_connections:
            return
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c._idle
                and not c.transport.is_closing()]
        if idle:
            min(idle, key=lambda c: c._idle_since).transport.close()
            self.on_closed("room")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to malformed HTTP, in OpenAI's shape and counted like every other."""
        response = error_response(400, "the request is not valid HTTP/1.1", code="invalid_http")
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=response.body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
        self.on_refused(400, "invalid_http")


def guarded_protocol(header_timeout: float, max_connections: int, on_closed: Callable[[str], None],
                     on_refused: Callable[[int, str], None]) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn.Config(http=...), with these limits and counters."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections,
                 "on_closed": staticmethod(on_closed), "on_refused": staticmethod(on_refused)})


class BodyAdmission:
    """ASGI middleware: each request body read under the rules of the module docstring, then
    replayed to the app. A body counts against the caps on bodies still arriving only once it is
    seen to be one: when the first part the server has of it does not complete it, or nothing of
    it has come within QUICK seconds. A burst of small requests from one address (64 clients
    behind one proxy) is not held to them. `on_refused(reason)` counts a refusal."""

    QUICK = 0.1

    def __init__(self, app, max_bytes: int, timeout: float, min_rate: float, grace: float, per_client: int,
                 total: int, on_refused: Callable[[str], None]):
        self.app, self.max_bytes, self.timeout, self.min_rate, self.grace = app, max_bytes, timeout, min_rate, grace
        self.per_client, self.total, self.on_refused = per_client, total, on_refused
        self.arriving: dict[str, int] = {}  # client -> connections whose body is still arriving
        self.arriving_total = 0

    async def _refuse(self, send, status: int, reason: str, message: str, code: str) -> None:
        self.on_refused(reason)
        response = error_response(status, message, code=code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [*response.raw_headers, (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": response.body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if (declared is None and b"transfer-encoding" not in headers) or declared == b"0":
            return await self.app(scope, receive, send)  # no body: nothing to admit
        # JSON only: a web page may post text/plain, a form or an untyped blob to any address without
        # asking first (CORS "simple requests"), and so reach a server that has no --api-key.
        media_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media_type != b"application/json":
            return await self._refuse(send, 415, "unsupported_media_type", "request bodies must be JSON, sent with "
                                      f"Content-Type: application/json (got {media_type.decode('latin-1') or 'none'!r})",
                                      "unsupported_media_type")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, 413, "body_too_large", f"request body of {int(declared)} bytes is over the "
                                      f"{self.max_bytes}-byte limit (--max-request-size)", "request_too_large")
        body = await self._read(client_of(scope), receive, send)
        if body is None:  # refused, or the client hung up
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _admit(self, client: str, send) -> bool:
        """Count a body still arriving, or refuse it (False) past the caps."""
        if self.arriving.get(client, 0) >= self.per_client:
            await self._refuse(send, 429, "too_many_uploads", f"this client already has {self.per_client} connections "
                               "sending a request body (--max-client-uploads); finish those first", "too_many_requests")
            return False
        if self.arriving_total >= self.total:
            await self._refuse(send, 503, "server_busy", f"{self.total} connections are sending request bodies, the "
                               "most the server reads at once; retry shortly", "server_busy")
            return False
        self.arriving[client] = self.arriving.get(client, 0) + 1
        self.arriving_total += 1
        return True

    async def _read(self, client: str, receive, send) -> bytes | None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        chunks, size, more, counted = [], 0, True, False
        try:
            while more:
                # The next bytes are due when the average since `start` would fall under min_rate.
                due = min(start + self.timeout, start + self.grace + size / self.min_rate)
                quick = not counted and start + self.QUICK < due
                try:
                    message = await asyncio.wait_for(receive(), (start + self.QUICK if quick else due) - loop.time())
                except asyncio.TimeoutError:
                    if quick:  # nothing yet: a body still arriving
                        if not await self._admit(client, send):
                            return None
                        counted = True
                        continue
                    if loop.time() >= start + self.timeout:
                        message = f"the request body did not arrive within {self.timeout:g} s (--body-timeout)"
                    else:
                        message = (f"the request body arrived at less than {self.min_rate:g} bytes/s (--min-body-rate): "
                                   f"{size} bytes in {loop.time() - start:.0f} s")
                    await self._refuse(send, 408, "body_too_slow", message, "request_timeout")
                    return None
                if message["type"] != "http.request":  # disconnected while sending the body
                    return None
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > self.max_bytes:
                    await self._refuse(send, 413, "body_too_large", f"request body is over the {self.max_bytes}-byte "
                                       "limit (--max-request-size)", "request_too_large")
                    return None
                if more and not counted:
                    if not await self._admit(client, send):
                        return None
                    counted = True
            return b"".join(chunks)
        finally:
            if counted:
                self.arriving_total -= 1
                self.arriving[client] -= 1
                if not self.arriving[client]:
                    del self.arriving[client]


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
