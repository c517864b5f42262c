"""A structured-output request (StructuredOutputsParams) as a regular expression.

JSON schemas become regexes through outlines-core's `build_regex_from_schema`, after a check that
the schema uses only keywords that regex enforces (`ENFORCED`) or that change nothing about which
documents are valid (`ANNOTATIONS`): every other keyword is refused with its path, since the output
would not be guaranteed to validate. `json_object` is any JSON object nested at most
`JSON_OBJECT_DEPTH` containers deep (arbitrary nesting is not regular). Choices are an alternation
of literal strings. The regex dialect is outlines-core's (Rust's regex syntax, matched whole).
"""

from __future__ import annotations

import json

from blockdiff.sampling_params import InvalidParam, StructuredOutputsParams

# Keywords whose every constraint the generated regex enforces.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "enum", "const", "anyOf", "allOf", "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "format",
})
# Keywords that do not change which documents validate.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "strict", "discriminator",
})
FORMATS = frozenset({"date-time", "date", "time", "uuid", "email", "uri"})
JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
JSON_OBJECT_DEPTH = 3
# The longest regex a constraint may have (a JSON schema's is checked in the build process, whose
# memory is bounded, a forced tool call's before its text is written): 750x the 1,390 characters
# of the 20-field schema of benchmarks/structured_outputs.py (docs/structured_outputs.md, "Bounds").
MAX_REGEX_CHARS = 2**20
WHITESPACE = r"[ ]?"  # between JSON tokens: at most one space (outlines-core's default)
_META = set("\\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
    """`text` as a literal in outlines-core's regex syntax."""
    return "".join("\\" + c if c in _META else c for c in text)


def check_supported(spec: StructuredOutputsParams) -> None:
    """InvalidParam for what is refused before any automaton is built: grammars, JSON schemas with
    keywords that would not be enforced."""
    if spec.grammar is not None:
        raise InvalidParam("structured_outputs", "structured_outputs.grammar: context-free grammars are not supported "
                                                 "(a canvas is constrained by a finite automaton); use json, regex or "
                                                 "choice")
    if spec.json is not None:
        try:
            check_schema(schema_of(spec))
        except RecursionError:  # the server bounds nesting when it decodes; a library caller may not
            raise InvalidParam("structured_outputs", "the JSON schema nests too deep") from None


def schema_of(spec: StructuredOutputsParams):
    """The JSON schema of `spec` (a dict, or decoded from its JSON text)."""
    if not isinstance(spec.json, str):
        return spec.json
    try:
        return json.loads(spec.json)
    except json.JSONDecodeError as e:
        raise InvalidParam("structured_outputs", f"structured_outputs.json is not JSON: {e}") from None


def regex_job(spec: StructuredOutputsParams) -> tuple:
    """What the build process turns into the regex a request's output must match whole
    (index.regex_of): ("regex", regex), or ("schema", schema JSON, whitespace) for a JSON schema,
    whose regex may be far larger than the schema; InvalidParam naming what cannot be served."""
    check_supported(spec)
    if spec.regex is not None:
        return ("regex", spec.regex)
    if spec.choice is not None:
        return ("regex", "(" + "|".join(escape(c) for c in spec.choice) + ")")
    if spec.json_object:
        return ("regex", json_object_regex(spec.whitespace_pattern or WHITESPACE))
    return ("schema", json.dumps(schema_of(spec)), spec.whitespace_pattern or WHITESPACE)


def check_schema(schema, path: str = "#") -> None:
    """InvalidParam unless every keyword of `schema` is enforced or an annotation."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidParam("structured_outputs", f"JSON schema {path}: a schema is an object, got {schema!r:.80}")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            raise InvalidParam("structured_outputs", f"JSON schema {where}: the keyword {key!r} is not supported (its "
                                                     "constraint could not be guaranteed); supported: "
                                                     f"{', '.join(sorted(ENFORCED))}")
        if key == "type":
            types = value if isinstance(value, list) else [value]
            bad = [t for t in types if t not in JSON_TYPES]
            if bad:
                raise InvalidParam("structured_outputs", f"JSON schema {where}: unknown type {bad[0]!r}")
        elif key == "format" and value not in FORMATS:
            raise InvalidParam("structured_outputs", f"JSON schema {where}: the format {value!r} is not supported; "
                                                     f"supported: {', '.join(sorted(FORMATS))}")
        elif key == "additionalProperties" and not isinstance(value, bool):
            raise InvalidParam("structured_outputs", f"JSON schema {where}: only true or false is supported (the "
                                                     "output has the listed properties only)")
        elif key in ("enum", "anyOf") and (not isinstance(value, list) or not value):
            raise InvalidParam("structured_outputs", f"JSON schema {where}: {key} must be a non-empty list (no value "
                                                     "matches an empty one)")
        elif key == "allOf" and (not isinstance(value, list) or len(value) != 1):
            raise InvalidParam("structured_outputs", f"JSON schema {where}: allOf is supported with one schema only")
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
        elif key in ("anyOf", "allOf", "prefixItems") and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}")
        elif key == "items":
            check_schema(value, where)


def json_object_regex(ws: str = WHITESPACE, depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object with containers nested at most `depth` deep."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING

    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"

    def container(d: int) -> tuple[str, str]:
        value = scalar if d == 1 else "(" + scalar + "|" + "|".join(container(d - 1)) + ")"
        member = f"{STRING}{ws}:{ws}{value}"
        obj = rf"\{{{ws}({member}({ws},{ws}{member})*)?{ws}\}}"
        arr = rf"\[{ws}({value}({ws},{ws}{value})*)?{ws}\]"
        return obj, arr

    return container(depth)[0]
