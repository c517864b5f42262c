"""OpenAI-style errors: every failure leaves the server as {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockdiff.engine.async_engine import EngineUnavailable, QueueFull, RequestFailed
from blockdiff.sampling_params import InvalidParam

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


# pydantic names the member of a union in an error's location ("prompt", "list[int]", 0).
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@contextmanager
def renamed_params(names: dict[str, str]) -> Iterator[None]:
    """Errors of the chat machinery about fields under their chat names, raised under another
    API's names (`names`: chat name -> that API's), the message's leading name too."""
    try:
        yield
    except APIError as e:
        name = names.get(e.param)
        if name is None:
            raise
        message = name + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
        raise APIError(e.status, message, param=name, code=e.code) from None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def bad_value(e: ValueError, fields: set[str], renames: dict[str, str]) -> APIError:
    """A ValueError from the engine or SamplingParams -> 400. An `InvalidParam` names its field,
    which becomes `param` when it is a request field, under the name this request sent it as
    (`renames`: engine name -> request field)."""
    message = str(e)
    field = e.field if isinstance(e, InvalidParam) else None
    if field in renames and message.startswith(field):  # the message speaks of the field as this request sent it
        message = renames[field] + message[len(field):]
    return APIError(400, message, param=renames.get(field, field) if field in fields else None)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line per offending field; a field that matched none of a union's forms reports the first."""
    parts, seen, param = [], set(), None
    # A list over its bound matched the union's list form: that is the error to report.
    for err in sorted(errors, key=lambda err: err.get("type") != "too_long"):
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = loc[0] if loc else None
        if field in seen:
            continue
        seen.add(field)
        param = param or field
        where = ".".join(x for x in loc if not _UNION_TAG.match(x)) or "request body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts), param


def _refused(request: Request, status: int, message: str, param: str | None = None,
             code: str | None = None) -> JSONResponse:
    """A client error's response, its reason logged at info: uvicorn's access log says only the status."""
    log.info("%s %s -> %d: %s%s", request.method, request.url.path, status, message,
             f" (param: {param})" if param else "")
    return error_response(status, message, param, code)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _refused(request, e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(e.errors()))
        return _refused(request, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        return error_response(e.status_code, message)

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, e: QueueFull) -> JSONResponse:
        return error_response(429, str(e), code="queue_full")

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, e: EngineUnavailable) -> JSONResponse:
        return error_response(503, str(e), code="engine_unavailable")

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, e: RequestFailed) -> JSONResponse:
        return error_response(500, str(e), code="request_failed")

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(e).__name__}")
