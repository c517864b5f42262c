"""A request's structured-output fields as one StructuredOutputsParams: OpenAI's response_format,
vLLM's structured_outputs and its older guided_* fields, and the tool calls a forced tool_choice
demands, written in the Gemma 4 call format (tool_parsers.py) with each argument constrained by the
tool's parameter schema.

Both run in the preprocessing pool, off the event loop: a schema sent as JSON text is decoded with
the request body's bounds on nesting and size (body.py), and a forced call's regex is refused
before it is written if it would be longer than MAX_REGEX_CHARS (each optional property multiplies
its object's alternatives, and each array level doubles its items' regex). A JSON schema's regex
is made by the automaton's build process, under its memory bound (blockdiff/structured/builds.py)."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace

from blockdiff.entrypoints.openai import protocol as p
from blockdiff.entrypoints.openai.body import MAX_JSON_VALUES, Budget, decode_json
from blockdiff.entrypoints.openai.errors import APIError
from blockdiff.entrypoints.openai.tool_parsers import Gemma4ToolParser
from blockdiff.sampling_params import InvalidParam, StructuredOutputsParams
from blockdiff.structured.regexes import ANNOTATIONS, MAX_REGEX_CHARS, check_supported, escape
from blockdiff.structured.vocabulary import symbol

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constraint_field(req: p._GenerationRequest) -> str | None:
    """The request field that asks for a structured output (at most one may), or None."""
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED) if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.type == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise APIError(400, f"{given[0]} and {given[1]} both constrain the output: give one", param=given[1])
    return given[0] if given else None


def request_constraint(req: p._GenerationRequest) -> StructuredOutputsParams | None:
    """The constraint the request's own fields ask for, checked as far as it can be before its
    automaton is built (errors name the field the request used), or None."""
    name = constraint_field(req)
    if name is None:
        return None
    try:
        spec = _decoded(_constraint(req, name), name)
        check_supported(spec)
        return spec
    except InvalidParam as e:
        raise APIError(400, str(e).replace("structured_outputs", name, 1), param=name) from None


def _decoded(spec: StructuredOutputsParams, name: str) -> StructuredOutputsParams:
    """`spec` with a schema sent as JSON text decoded within the body's bounds (400 past them)."""
    if not isinstance(spec.json, str):
        return spec
    what = f"{name}.json" if name == "structured_outputs" else name
    try:
        schema = decode_json(spec.json, what, Budget(max_items=MAX_JSON_VALUES))
    except json.JSONDecodeError as e:
        raise APIError(400, f"{what} is not JSON: {e}", param=name) from None
    except APIError as e:
        raise APIError(400, e.message, param=name) from None
    return replace(spec, json=schema)


def _constraint(req: p._GenerationRequest, name: str) -> StructuredOutputsParams:
    if name == "response_format":
        fmt = req.response_format
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema", param="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    if name == "structured_outputs":
        so = req.structured_outputs
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object, whitespace_pattern=so.whitespace_pattern)
    kind = name.removeprefix("guided_")
    return StructuredOutputsParams(**{kind: getattr(req, name)}, whitespace_pattern=req.guided_whitespace_pattern)


# ---- tool calls in the Gemma 4 format -------------------------------------------------------------
_START, _END, _QUOTE = (symbol(k) for k in range(3))
MARKERS = (Gemma4ToolParser.start, Gemma4ToolParser.end, Gemma4ToolParser.quote)  # the symbols above, in order
# A string argument: text without control characters, the format's markers, or a "<|" that the
# parser could read as one spelt out.
_TEXT = f"([^<\\x00-\\x1f{_START}{_END}{_QUOTE}]|<+[^<|\\x00-\\x1f{_START}{_END}{_QUOTE}])*<*"
_INTEGER = r"-?(0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_ANY_DEPTH = 2  # containers an argument without a schema may nest
_ARGUMENT_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                                "enum", "const", "anyOf", "$ref", "$defs", "definitions"})
_BARE_KEY = re.compile(r"[\w\-.]+\Z")


def tool_call_constraint(tools: list[p.Tool], allowed: frozenset[str], parallel: bool) -> StructuredOutputsParams:
    """The output as calls of the `allowed` tools (one, or one or more when `parallel`), each
    call's arguments matching its tool's parameter schema."""
    calls = []
    for tool in tools:
        f = tool.function
        if f.name in allowed:
            schema = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
            try:
                args = _Arguments(schema).object_members(schema, "#")
            except InvalidParam as e:
                raise APIError(400, f"tool {f.name!r}: {e}", param="tools") from None
            calls.append(f"{_START}call:{escape(f.name)}\\{{{args}\\}}{_END}")
    _bounded(sum(map(len, calls)) * (2 if parallel else 1), "the forced tool calls")
    call = "(" + "|".join(calls) + ")"
    return StructuredOutputsParams(regex=call + (f"({call})*" if parallel else ""), special_tokens=MARKERS)


class _Arguments:
    """JSON schema -> regex of the Gemma 4 argument syntax: bare keys in sorted order (as the chat
    template writes them), strings between quote tokens, bare numbers, true, false and null."""

    def __init__(self, root: dict):
        self.root = root
        self.refs = 0

    def value(self, schema, path: str, depth: int = 0) -> str:
        if schema is True or schema == {}:
            return self.any(_ANY_DEPTH)
        if not isinstance(schema, dict):
            raise InvalidParam("tools", f"parameters {path}: a schema is an object, got {schema!r:.60}")
        bad = sorted(set(schema) - _ARGUMENT_KEYWORDS - ANNOTATIONS)
        if bad:
            raise InvalidParam("tools", f"parameters {path}: the keyword {bad[0]!r} is not supported in a forced tool "
                                        f"call's arguments; supported: {', '.join(sorted(_ARGUMENT_KEYWORDS))}")
        if "$ref" in schema:
            self.refs += 1
            if self.refs > 64:
                raise InvalidParam("tools", f"parameters {path}: $ref nests too deep (recursive schemas are not regular)")
            return self.value(self._resolve(schema["$ref"], path), schema["$ref"], depth)
        if "const" in schema:
            return self.literal(schema["const"], path)
        for key in ("enum", "anyOf"):
            if key in schema and (not isinstance(schema[key], list) or not schema[key]):
                raise InvalidParam("tools", f"parameters {path}/{key}: must be a non-empty list (no value matches an "
                                            "empty one)")
        if "enum" in schema:
            return _alternation([self.literal(v, path) for v in schema["enum"]], path)
        if "anyOf" in schema:
            return _alternation([self.value(s, f"{path}/anyOf/{i}", depth) for i, s in enumerate(schema["anyOf"])], path)
        types = schema.get("type")
        if types is None:
            return self.any(_ANY_DEPTH)
        types = types if isinstance(types, list) else [types]
        return _alternation([self.typed(t, schema, path, depth) for t in types], path)

    def typed(self, t: str, schema: dict, path: str, depth: int) -> str:
        if t == "string":
            return f"{_QUOTE}{_TEXT}{_QUOTE}"
        if t == "integer":
            return _INTEGER
        if t == "number":
            return _NUMBER
        if t == "boolean":
            return "(true|false)"
        if t == "null":
            return "null"
        if t == "object":
            if "properties" not in schema and schema.get("additionalProperties", True) is not False:
                return self.any_object(_ANY_DEPTH)
            return r"\{" + self.object_members(schema, path, depth) + r"\}"
        if t == "array":
            item = self.value(schema.get("items", True), f"{path}/items", depth + 1)
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if high == 0:
                return r"\[\]"
            _bounded(2 * len(item), path)  # each array level doubles its items' regex
            rest = f"(,{item}){{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
            body = f"{item}{rest}"
            return r"\[" + (body if low > 0 else f"({body})?") + r"\]"
        raise InvalidParam("tools", f"parameters {path}: unknown type {t!r}")

    def object_members(self, schema: dict, path: str, depth: int = 0) -> str:
        """`key:value,...` of an object schema's properties (sorted), the required ones present."""
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        unknown = sorted(required - set(props))
        if unknown:
            raise InvalidParam("tools", f"parameters {path}: required property {unknown[0]!r} has no schema")
        names = sorted(props)
        members = [self.key(n) + ":" + self.value(props[n], f"{path}/properties/{n}", depth + 1) for n in names]
        need = [n in required for n in names]
        # Each member is present or not (required ones always); commas go between present ones. The
        # alternatives repeat the members after their first, so their length is checked first.
        last = next((i for i, n in enumerate(need) if n), len(names) - 1)
        after = list(itertools.accumulate((len(m) + 4 for m in reversed(members)), initial=0))[::-1]  # members j.. of each
        _bounded(sum(len(members[f]) + after[f + 1] for f in range(last + 1)), path)
        alternatives = []
        for first in range(len(names)):
            rest = "".join(f",{m}" if need[j] else f"(,{m})?" for j, m in enumerate(members) if j > first)
            alternatives.append(members[first] + rest)
            if need[first]:
                break
        body = "(" + "|".join(alternatives) + ")" if alternatives else ""
        return body if any(need) else f"({body})?" if body else ""

    def key(self, name: str) -> str:
        return escape(name) if _BARE_KEY.match(name) else f"{_QUOTE}{escape(name)}{_QUOTE}"

    def literal(self, v, path: str) -> str:
        if isinstance(v, str):
            return _QUOTE + escape(v) + _QUOTE
        if isinstance(v, bool) or v is None:
            return json.dumps(v)
        if isinstance(v, (int, float)):
            return escape(repr(v))
        raise InvalidParam("tools", f"parameters {path}: enum and const values must be strings, numbers, booleans or null")

    def any(self, depth: int) -> str:
        scalar = f"({_QUOTE}{_TEXT}{_QUOTE}|{_NUMBER}|true|false|null)"
        if depth == 0:
            return scalar
        inner = self.any(depth - 1)
        return f"({scalar}|{self.any_object(depth)}|\\[({inner}(,{inner})*)?\\])"

    def any_object(self, depth: int) -> str:
        inner = self.any(depth - 1) if depth > 0 else self.any(0)
        member = f"[A-Za-z_][\\w\\-.]*:{inner}"
        return f"\\{{({member}(,{member})*)?\\}}"

    def _resolve(self, ref: str, path: str):
        if not ref.startswith("#/"):
            raise InvalidParam("tools", f"parameters {path}: only local $refs (#/...) are supported, got {ref!r}")
        node = self.root
        for part in ref[2:].split("/"):
            if not isinstance(node, dict) or part not in node:
                raise InvalidParam("tools", f"parameters {path}: $ref {ref!r} points nowhere")
            node = node[part]
        return node


def _bounded(chars: int, path: str) -> None:
    """400 before a forced call's regex of more than MAX_REGEX_CHARS characters is written."""
    if chars > MAX_REGEX_CHARS:
        raise InvalidParam("tools", f"parameters {path}: the arguments' regex would have {chars} characters, "
                                    f"more than the {MAX_REGEX_CHARS} a constraint may have (optional properties "
                                    "multiply it): make more properties required or the schema smaller")


def _alternation(parts: list[str], path: str) -> str:
    _bounded(sum(map(len, parts)) + len(parts) + 1, path)
    return "(" + "|".join(parts) + ")"
