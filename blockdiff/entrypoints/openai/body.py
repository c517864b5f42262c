"""JSON decoded and validated in bounded time and memory: request bodies, and the tool-call
arguments that a chat request carries as JSON strings.

Decoding runs in the preprocessing pool (work_pool.py), never on the event loop. json.loads and
pydantic run in C and hold the GIL for the whole call: on a 15 MB body of small objects that is
0.4 s each, during which no other thread runs, the event loop included. So a large body (and every
arguments string) is decoded by the pure-Python JSON scanner, whose bytecode gives the GIL back
every few milliseconds (strings still go through the C string scanner). It counts the objects and
arrays as it goes (MAX_JSON_CONTAINERS in a body, and as many in all the arguments of a request),
refuses nesting deeper than MAX_JSON_DEPTH, and checks the request's deadline every few hundred
values, so decoding stops before the containers of a hostile body pile up. Pydantic then validates
at most that many containers. Small bodies take the C scanner, and a walk checks them after.

Text that cannot be encoded (a lone UTF-16 surrogate such as "\\ud800") is refused here with a
400 naming where it is: the tokenizer, the chat template and the JSON encoder of any response
echoing it would otherwise fail with a 500.
"""

from __future__ import annotations

import json
import logging
import re
from json import scanner
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.protocol import ignored_fields
from blockdiff.entrypoints.openai.work_pool import WorkPool, check_deadline

log = logging.getLogger(__name__)

LARGE_BODY = 2**20  # bytes; larger bodies are decoded by the pure-Python scanner
MAX_JSON_CONTAINERS = 32768  # objects and arrays in one body (messages, content parts and lists are some)
MAX_JSON_DEPTH = 64  # objects and arrays nested in each other
MAX_JSON_VALUES = 2**21  # values in one body: pydantic validates them in one call, holding the GIL
_CHECK_EVERY = 512  # values decoded between two deadline checks

Model = TypeVar("Model", bound=BaseModel)
_SURROGATE = re.compile("[\ud800-\udfff]")
# A flat list of integers (token ids): decoded by the C scanner, a list at a time.
_INT_LIST = re.compile(r"\[\s*-?\d+(?:\s*,\s*-?\d+)*\s*\]")
_INT_CHARS = 24  # the most characters one integer item of such a list takes, beyond which it is not one


class _TooMany(Exception):
    pass


class _TooDeep(Exception):
    pass


class _TooLong(Exception):
    pass


class _NotANumber(Exception):
    pass


def _refuse_constant(name: str):
    """Python's json reads NaN, Infinity and -Infinity, which JSON does not have (OpenAI refuses them)."""
    raise _NotANumber(name)


class Budget:
    """What one body, or all the arguments of one request, may still hold: containers, values, and
    items in any one array (the longest list a field takes)."""

    def __init__(self, max_items: int):
        self.max_items = max_items
        self.left = MAX_JSON_CONTAINERS
        self.values = 0

    def container(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _TooMany

    def value(self) -> None:
        self.values += 1
        if self.values > MAX_JSON_VALUES:
            raise _TooMany
        if self.values % _CHECK_EVERY == 0:
            check_deadline()


def _pure_python_decoder(budget: Budget) -> json.JSONDecoder:
    decoder = json.JSONDecoder(parse_constant=_refuse_constant)
    depth = 0

    def counted(scan_once, max_items: float):
        items = 0

        def scan(string, idx):
            nonlocal items
            items += 1
            if items > max_items:
                raise _TooLong
            budget.value()
            return scan_once(string, idx)
        return scan

    def container(parse, scan_at: int, max_items: float):
        def parse_counted(*args):
            nonlocal depth
            budget.container()
            depth += 1
            try:
                if depth > MAX_JSON_DEPTH:
                    raise _TooDeep
                if scan_at == 1:
                    ints = _int_list(*args[0], budget)
                    if ints is not None:
                        return ints
                args = (*args[:scan_at], counted(args[scan_at], max_items), *args[scan_at + 1:])
                return parse(*args)
            finally:
                depth -= 1
        return parse_counted

    # py_make_scanner reads these two when it is built; each gets the scanner as an argument.
    decoder.parse_object = container(decoder.parse_object, 2, float("inf"))  # (s_and_end, strict, scan_once, ...)
    decoder.parse_array = container(decoder.parse_array, 1, budget.max_items)  # (s_and_end, scan_once, ...)
    decoder.scan_once = scanner.py_make_scanner(decoder)
    return decoder


def _int_list(string: str, idx: int, budget: Budget) -> tuple[list[int], int] | None:
    """The flat list of integers whose "[" is just before `idx`, decoded in C, and where it ends;
    None if there is none there of at most budget.max_items items (the scan is bounded to as many)."""
    found = _INT_LIST.match(string, idx - 1, idx - 1 + budget.max_items * _INT_CHARS)
    if found is None:
        return None
    ints = json.loads(found.group())
    if len(ints) > budget.max_items:
        raise _TooLong
    budget.values += len(ints)
    if budget.values > MAX_JSON_VALUES:
        raise _TooMany
    check_deadline()
    return ints, found.end()


def _c_decoder(budget: Budget) -> json.JSONDecoder:
    def counted(pairs: list[tuple[str, Any]]) -> dict:
        budget.container()
        return dict(pairs)

    return json.JSONDecoder(object_pairs_hook=counted, parse_constant=_refuse_constant)


def _walk(value: Any, budget: Budget | None) -> bool:
    """Whether any string (or key) under `value` holds a lone surrogate; counts its arrays against
    `budget` (its objects are counted already) and checks the depth. Iterative: no recursion limit."""
    bad = False
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            bad = bad or _SURROGATE.search(value) is not None
            continue
        if isinstance(value, dict):
            bad = bad or any(_SURROGATE.search(k) for k in value)
            items = value.values()
        elif isinstance(value, list):
            if budget is not None:
                budget.container()
                if len(value) > budget.max_items:
                    raise _TooLong
            items = value
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise _TooDeep
        stack.extend((v, depth + 1) for v in items if isinstance(v, (str, dict, list)))
    return bad


def _bad_text(value: Any, where: str = "") -> str | None:
    """The path of the first string (or key) holding a lone surrogate, or None (depth already bounded)."""
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


def decode_json(text: str, what: str, budget: Budget, pure_python: bool = True) -> Any:
    """`text` decoded within `budget`, its strings checked; APIError (400) naming `what` otherwise."""
    try:
        if pure_python:
            value = _pure_python_decoder(budget).decode(text)
            surrogates = _walk(value, None)
        else:
            value = _c_decoder(budget).decode(text)
            surrogates = _walk(value, budget)
    except json.JSONDecodeError:
        raise
    except _TooMany:
        raise APIError(400, f"{what} holds more than {MAX_JSON_CONTAINERS} JSON objects and arrays, or more than "
                            f"{MAX_JSON_VALUES} values") from None
    except _TooLong:
        raise APIError(400, f"{what} holds a list of more than {budget.max_items} items, longer than any field "
                            "takes") from None
    except _NotANumber as e:
        raise APIError(400, f"{what} holds {e}, which is not a JSON number") from None
    except (_TooDeep, RecursionError):
        raise APIError(400, f"{what} nests JSON objects and arrays more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as e:  # Python's limit on the digits of an integer (4,300)
        raise APIError(400, f"{what} holds a number Python cannot read: {e}") from None
    if surrogates:
        where = _bad_text(value)
        body = what == "the request body"
        raise APIError(400, f"{where if body else what + ' at ' + where}: text holds a lone UTF-16 surrogate (an "
                            "unpaired \\ud800-\\udfff escape), which is not a character",
                       param=_param(where) if body else None)
    return value


def _param(where: str) -> str | None:
    param = where.split(".", 1)[0].split("[", 1)[0]
    return param if param != "request body" else None


def parse_body(body: bytes, model: type[Model], max_items: int) -> Model:
    """The body as `model`; raises RequestValidationError or APIError (both become a 400)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = decode_json(text, "the request body", Budget(max_items), pure_python=len(body) > LARGE_BODY)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


class BodyParser:
    """Request bodies decoded and validated in the preprocessing pool, fair across clients.
    `max_items`: the longest list any field takes (prompt ids, messages, prompts). Unknown top-level
    fields of the bodies that allow them are refused with `strict_fields`, else logged and ignored."""

    def __init__(self, pool: WorkPool, max_items: int, strict_fields: bool):
        self.pool, self.max_items, self.strict_fields = pool, max_items, strict_fields

    async def __call__(self, body: bytes, model: type[Model], client: str) -> Model:
        parsed = await self.pool.run(client, parse_body, body, model, self.max_items)
        extra = parsed.model_extra or {}
        # A client picks these names: a few, cut short, are enough to say what was ignored.
        unknown = [name if len(name) <= 64 else name[:64] + "..." for name in sorted(extra)[:8]]
        unknown += [f"and {len(extra) - 8} more"] if len(extra) > 8 else []
        if unknown and self.strict_fields:
            raise APIError(400, f"unknown request field{'s' if len(extra) > 1 else ''} {', '.join(unknown)} (the server "
                                "refuses unknown fields: --strict-request-fields)", param=unknown[0])
        ignored = ignored_fields(parsed) + [f"{f} (unknown)" for f in unknown]
        if ignored:
            log.warning("request fields ignored: %s", ", ".join(ignored))
        return parsed
