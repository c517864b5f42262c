"""Clients and their share of the engine. A client is the address a request comes from: a bearer
token would not do, since without --api-key any token is accepted, and with it every client sends
the same one. Behind a reverse proxy every client is the proxy, unless the proxy's address is in
--forwarded-allow-ips: from those peers only, uvicorn's ProxyHeadersMiddleware makes the client the
address X-Forwarded-For names (the last one no trusted proxy added), before any of the app runs.
From any other peer the header means nothing: a process on the server's host connects from
127.0.0.1 too, and would otherwise be whichever client it names. Every per-client mechanism reads
this one identity, `client_of`: --max-client-uploads (connections.py), the stored responses'
owner (responses.py), the prefix cache's scope (engine/kv_cache_manager.py), the turns of the
preprocessing pools and of the structured-output builds, and the client's engine requests, each
choice and prompt of a call one: against --max-client-concurrency here, and for fairness in the
scheduler (engine/scheduler.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blockdiff.entrypoints.openai.errors import APIError


def client_of(scope: Mapping[str, Any]) -> str:
    """The client of an ASGI scope, or of a starlette Request (a mapping over its scope)."""
    client = scope.get("client")
    return client[0] if client else ""


class ClientLimit:
    """The engine requests each client has in progress, at most `limit` (None: no limit)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.running: dict[str, int] = {}

    def hold(self, client: str, n: int) -> Callable[[], None]:
        """Count `n` more for `client`, or raise: 400 if n alone is over the limit, 429 while the
        client's requests in progress leave no room for them. -> what gives them back (once, however
        often it is called)."""
        if self.limit is not None:
            if n > self.limit:
                raise APIError(400, f"this request starts {n} engine requests (choices x prompts), more than the "
                                    f"{self.limit} one client may have in progress (--max-client-concurrency)",
                               param="n", code="too_many_requests")
            held = self.running.get(client, 0)
            if held + n > self.limit:
                raise APIError(429, f"this client has {held} engine requests in progress and this request would add "
                                    f"{n}, more than --max-client-concurrency={self.limit} (each choice and prompt "
                                    "counts); retry when some end", code="too_many_requests")
            self.running[client] = held + n
        released = False

        def release() -> None:
            nonlocal released
            if self.limit is not None and not released:
                self.running[client] -= n
                if not self.running[client]:
                    del self.running[client]
            released = True

        return release
