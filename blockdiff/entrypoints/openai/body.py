"""Request bodies decoded and validated in bounded time and memory, without stalling the event loop.

json.loads and pydantic run in C and hold the GIL for the whole call: on a 15 MB body of small
objects that is 0.4 s each, during which no other request (not even /health) is answered, and a
thread does not help. So a large body is decoded in a thread by the pure-Python JSON scanner,
whose bytecode gives the GIL back every few milliseconds (strings still go through the C string
scanner), and decoding stops at the MAX_JSON_OBJECTS-th object, before the objects of a hostile
body pile up. Pydantic then validates at most that many objects. Small bodies take the fast path.

Text that cannot be encoded (a lone UTF-16 surrogate such as "\\ud800") is refused here with a
400 naming where it is: the tokenizer, the chat template and the JSON encoder of any response
echoing it would otherwise fail with a 500.
"""

from __future__ import annotations

import asyncio
import json
import re
from json import scanner
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from blockdiff.entrypoints.openai.errors import APIError

LARGE_BODY = 2**20  # bytes; above this, decoding moves off the event loop
MAX_JSON_OBJECTS = 16384  # JSON objects ({...}) in one body; messages and content parts are objects

Model = TypeVar("Model", bound=BaseModel)
_SURROGATE = re.compile("[\ud800-\udfff]")


class _TooManyObjects(Exception):
    pass


def _decoder(pure_python: bool) -> json.JSONDecoder:
    count = 0

    def counted(pairs: list[tuple[str, Any]]) -> dict:
        nonlocal count
        count += 1
        if count > MAX_JSON_OBJECTS:
            raise _TooManyObjects
        return dict(pairs)

    decoder = json.JSONDecoder(object_pairs_hook=counted)
    if pure_python:
        decoder.scan_once = scanner.py_make_scanner(decoder)
    return decoder


def _bad_text(value: Any, where: str = "") -> str | None:
    """The path of the first string (or key) holding a lone surrogate, or None."""
    if isinstance(value, str):
        return where or "request body" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{where}.{k}" if where else str(k)
            if _SURROGATE.search(k):
                return path
            found = _bad_text(v, path)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _bad_text(v, f"{where}[{i}]")
            if found:
                return found
    return None


def _decode(body: bytes, model: type[Model], pure_python: bool) -> Model:
    try:
        obj = _decoder(pure_python).decode(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    except _TooManyObjects:
        raise APIError(400, f"the request body holds more than {MAX_JSON_OBJECTS} JSON objects") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    where = _bad_text(obj)
    if where is not None:
        param = where.split(".", 1)[0].split("[", 1)[0]
        raise APIError(400, f"{where}: text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                            "which is not a character", param=param if param != "request body" else None)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


class BodyParser:
    def __init__(self):
        self._large = asyncio.Semaphore(1)  # one large body at a time: each takes a core for seconds

    async def __call__(self, body: bytes, model: type[Model]) -> Model:
        """The body as `model`; raises RequestValidationError or APIError (both become a 400)."""
        if len(body) <= LARGE_BODY:
            return _decode(body, model, pure_python=False)
        async with self._large:
            return await asyncio.to_thread(_decode, body, model, True)
