"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, on the /v1/messages paths.

The server makes its errors in OpenAI's shape in many places (the API key and body checks of its
middleware, the exception handlers, the 404 of an unknown path). Rewriting them on the way out, in
one middleware, gives every error on these paths Anthropic's shape, whichever layer made it, while
the OpenAI endpoints keep theirs.
"""

from __future__ import annotations

import json

PATH = "/v1/messages"

# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors"); others are "api_error".
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


def _message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, or the body itself when it is not one."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, TypeError, KeyError):
        return body.decode("utf-8", "replace")


class AnthropicErrors:
    """ASGI middleware: an error response (status 400 and up) on the /v1/messages paths is sent in
    Anthropic's shape; every other response passes as it is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"] == PATH or scope["path"].startswith(PATH + "/")):
            return await self.app(scope, receive, send)
        start: dict | None = None
        body = b""

        async def rewriting_send(message):
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            new = json.dumps(error_body(start["status"], _message(body))).encode()
            headers = [(k, v) for k, v in start["headers"] if k not in (b"content-length", b"content-type")]
            await send({**start, "headers": [*headers, (b"content-type", b"application/json"),
                                              (b"content-length", str(len(new)).encode())]})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, rewriting_send)
