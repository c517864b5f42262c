"""The fewest characters any output of a structured-output request has, from the request alone: so
that a constraint that no output within max_tokens can meet is refused before its automaton is
built (a string of minLength 100,000 is a DFA of 100,000 states: the build worker is held until
--structured-outputs-timeout for a request that could not be served anyway).

A lower bound, never more than the shortest valid output: a JSON schema's required members, its
string, array and const lengths count, whitespace not; a regex's minimum width is the one Python's
parser reads, where Python reads its syntax as outlines-core does (any doubt: no bound). Where
outlines-core's regex accepts less than the schema (it ignores minItems beside prefixItems), the
bound is the schema's: no valid output fits then.
"""

from __future__ import annotations

import functools
import json
import re
import warnings

try:
    from re import _parser as _regex_parser  # Python 3.11 on
except ImportError:
    import sre_parse as _regex_parser

from blockdiff.sampling_params import InvalidParam, StructuredOutputsParams
from blockdiff.structured.regexes import check_supported, schema_of

# Regex syntax Python reads otherwise than outlines-core (Rust's regex): verbose mode, whose Rust
# form also skips whitespace in classes and counted repetitions.
_VERBOSE = re.compile(r"\(\?[a-zA-Z-]*x")


def check_room(spec: StructuredOutputsParams, max_tokens: int, token_chars: int) -> None:
    """InvalidParam (max_tokens) when no output of `spec` fits in max_tokens tokens of at most
    `token_chars` characters each (the vocabulary's longest token, in bytes); or what
    `check_supported` refuses."""
    check_supported(spec)
    need = min_chars(spec)
    if need > max_tokens * token_chars:
        raise InvalidParam("max_tokens", f"max_tokens ({max_tokens}) is too small for the structured output, whose "
                                         f"shortest text has at least {need} characters: {max_tokens} tokens spell "
                                         f"at most {max_tokens * token_chars} (this vocabulary's longest token has "
                                         f"{token_chars} bytes)")


def min_chars(spec: StructuredOutputsParams) -> int:
    """A lower bound on the characters of any output `spec` (a supported one) accepts (0: none known)."""
    if spec.choice is not None:
        return min(map(len, spec.choice))
    if spec.json_object:
        return 2  # {}
    if spec.regex is not None:
        return _regex_min_chars(spec.regex)
    if spec.json is not None:
        schema = schema_of(spec)
        try:
            return _Schema(schema).min_chars(schema)
        except RecursionError:  # a const nested deeper than Python recurses (the server bounds nesting)
            return 0
    return 0


@functools.lru_cache(maxsize=64)  # a forced tool call's regex is long, and the same for every request of its tools
def _regex_min_chars(regex: str) -> int:
    if _VERBOSE.search(regex):
        return 0
    with warnings.catch_warnings():
        # Python warns of a class it reads otherwise than Rust's syntax ("[[:alpha:]]", "[a-z&&[^b]]")
        warnings.simplefilter("error", FutureWarning)
        try:
            return int(_regex_parser.parse(regex).getwidth()[0])
        except (re.error, FutureWarning, RecursionError, OverflowError):
            return 0


class _Schema:
    """A JSON schema's lower bound, each keyword a condition the value must meet (so the largest
    of their bounds holds), its local $refs resolved once each."""

    def __init__(self, root):
        self.root = root
        self.refs: dict[str, int] = {}

    def min_chars(self, schema) -> int:
        if not isinstance(schema, dict):
            return 0  # true (any value) or false (none): the build says which
        bounds = [self.typed(schema)]
        if "const" in schema:
            bounds.append(_value_chars(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            bounds.append(min(map(_value_chars, schema["enum"])))
        if isinstance(schema.get("anyOf"), list) and schema["anyOf"]:
            bounds.append(min(map(self.min_chars, schema["anyOf"])))
        if isinstance(schema.get("allOf"), list):
            bounds.extend(map(self.min_chars, schema["allOf"]))
        if isinstance(schema.get("$ref"), str):
            bounds.append(self.ref(schema["$ref"]))
        return max(bounds)

    def typed(self, schema: dict) -> int:
        types = schema.get("type")
        if types is None:
            return 0
        types = {t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)}  # each once
        return min(self.of_type(t, schema) for t in types) if types else 0

    def of_type(self, t: str, schema: dict) -> int:
        if t == "string":
            return 2 + _count(schema, "minLength")
        if t in ("boolean", "null"):
            return 4  # true, null
        if t == "object":
            required = schema.get("required")
            if not isinstance(required, list):
                return 2
            properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            names = list(dict.fromkeys(n for n in required if isinstance(n, str)))
            members = sum(2 + len(n) + 1 + max(1, self.min_chars(properties.get(n, True))) for n in names)
            return 2 + members + max(0, len(names) - 1)
        if t == "array":
            count = _count(schema, "minItems")
            if not count:
                return 2  # []
            prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
            first = [max(1, self.min_chars(s)) for s in prefix[:count]]
            rest = max(1, self.min_chars(schema.get("items", True))) if count > len(first) else 0
            return 2 + sum(first) + rest * (count - len(first)) + count - 1
        return 1  # a number

    def ref(self, ref: str) -> int:
        if ref in self.refs:  # resolved, or being resolved (a recursive schema): the bound of any value
            return self.refs[ref]
        self.refs[ref] = 1
        if ref.startswith("#/"):  # only local references are resolved (the build refuses others)
            node = self.root
            for part in ref[2:].split("/"):
                node = node.get(part) if isinstance(node, dict) else None
            self.refs[ref] = max(1, self.min_chars(node))
        return self.refs[ref]


def _count(schema: dict, key: str) -> int:
    value = schema.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _value_chars(value) -> int:
    """The fewest characters of `value` written as JSON (a number: at least one)."""
    if isinstance(value, str):
        return 2 + len(value)
    if isinstance(value, bool) or value is None:
        return len(json.dumps(value))
    if isinstance(value, list):
        return 2 + sum(map(_value_chars, value)) + max(0, len(value) - 1)
    if isinstance(value, dict):
        return 2 + sum(2 + len(k) + 1 + _value_chars(v) for k, v in value.items()) + max(0, len(value) - 1)
    return 1
