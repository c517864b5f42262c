"""Structured outputs through `LLM` (one rank and two gloo ranks): on a random tiny checkpoint,
whose text is noise, every output parses and validates against its JSON schema, matches its regex
or is one of its choices, across seeds and canvas boundaries; unconstrained requests in the same
batch are the bits they are alone; what cannot be guaranteed is refused."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest

from blockdiff import LLM, SamplingParams
from blockdiff.demo import demo_checkpoint
from blockdiff.model.tiny import TinySpec, build_tokenizer, make_tiny_model, save_tokenizer
from blockdiff.sampling_params import StructuredOutputsParams
from blockdiff.structured.compiler import StructuredOutputs, tokens_needed
from blockdiff.structured.lengths import min_chars
from blockdiff.structured.vocabulary import longest_token
from blockdiff.tokenizer import Tokenizer

# The tiny tokenizer learns its tokens from this text, so that JSON can be spelt (and with "▁" for spaces).
CORPUS = ('{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "v": null, "pi": -3.25e+2}\n' * 3
          + "The quick brown fox jumps over the lazy dog 0123456789 [] {} : , . _ - @ yes no maybe")

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                     "zip": {"type": "integer"}}, "required": ["city", "zip"]},
    }, "required": ["name", "address"]},
    "array_enum": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
        "level": {"enum": ["low", "high", 3, None]},
    }, "required": ["tags", "level"]},
    "numbers": {"type": "object", "properties": {
        "count": {"type": "integer"}, "ratio": {"type": "number"}, "ok": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 4},
    }, "required": ["count", "ratio", "ok"]},
    "optional": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}}},
    "list": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
             "maxItems": 3},
}
REGEXES = [r"[a-z]{2,6}@[a-z]{3}\.(com|org)", r"(yes|no|-?[0-9]{1,3}(\.[0-9]+)?)"]
CHOICES = ["red", "green", "blue sky"]


# Every canvas of a random checkpoint runs all its denoising steps: 8, not the default 48, reach
# the same constrained commits in a sixth of the steps.
JSON_TINY = TinySpec(vocab_size=320, canvas_length=8, sliding_window=6, seed=3, generation={"max_denoising_steps": 8})


def make_json_tiny(directory: str) -> str:
    path = make_tiny_model(directory, JSON_TINY)
    save_tokenizer(path, build_tokenizer(320, CORPUS))
    return path


@pytest.fixture(scope="module")
def json_tiny(tmp_path_factory) -> str:
    return make_json_tiny(str(tmp_path_factory.mktemp("json_tiny")))


@pytest.fixture(scope="module")
def llm(json_tiny):
    with LLM(json_tiny, max_model_len=256) as llm:
        yield llm


def constrained(seed: int, max_tokens: int = 64, **spec) -> SamplingParams:
    return SamplingParams(seed=seed, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec))


def check(out, spec: dict) -> None:
    assert out.finish_reason in ("stop", "length"), out
    if "json" in spec:
        jsonschema.validate(json.loads(out.text), spec["json"])
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], out.text), out.text
    else:
        assert out.text in spec["choice"]


def test_every_output_is_valid(llm):
    specs = [{"json": s} for s in SCHEMAS.values()] + [{"regex": r} for r in REGEXES] + [{"choice": CHOICES}]
    params = [constrained(seed, **spec) for spec in specs for seed in range(3)]
    outs = llm.generate(["Write it:"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        so = p.structured_outputs
        check(out, {k: v for k, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice)) if v is not None})
    # Outputs span canvas boundaries: the automaton's state carries from one canvas to the next.
    assert max(o.metrics["canvases"] for o in outs) >= 3


def test_outputs_stay_valid_when_max_tokens_cuts_them(llm):
    """With just enough tokens, the programme closes the text in time, whatever the noise."""
    schema = SCHEMAS["nested"]
    a = llm.engine.structured.automaton(StructuredOutputsParams(json=schema))
    need = int(a.distance[a.initial])  # the shortest text, in tokens
    budgets = (need, need + 1, need + 3, need + 9)
    outs = llm.generate(["x"] * 4, [constrained(seed, max_tokens=m, json=schema) for seed, m in enumerate(budgets)],
                        use_tqdm=False)
    for out, m in zip(outs, budgets):
        check(out, {"json": schema})
        assert len(out.token_ids) <= m


def test_json_object_and_string_schemas(llm):
    outs = llm.generate(["a", "b"], [constrained(1, json_object=True), constrained(2, json=json.dumps(SCHEMAS["list"]))],
                        use_tqdm=False)
    assert isinstance(json.loads(outs[0].text), dict)
    jsonschema.validate(json.loads(outs[1].text), SCHEMAS["list"])


def test_every_steps_per_launch_commits_the_same(json_tiny):
    """A canvas that finished inside a launch of several steps would commit from a later step's
    distribution: a step with a constrained canvas runs one denoising step, so every K commits what
    K = 1 does. The canvases stop at different steps (3 and 7), so a launch of 4 would hold a finish."""
    params = [replace(constrained(1, json=SCHEMAS["nested"]), max_denoising_steps=3),
              replace(constrained(2, regex=REGEXES[0]), max_denoising_steps=7),
              SamplingParams(seed=3, max_tokens=24, max_denoising_steps=5, ignore_eos=True)]
    outs = {}
    for k in (1, 4):
        with LLM(json_tiny, max_model_len=256, num_scheduler_steps=k) as llm:
            outs[k] = [(o.token_ids, o.metrics["denoising_steps"]) for o in
                       llm.generate(["a", "b", "c"], params, use_tqdm=False)]
    assert outs[4] == outs[1]


def test_unconstrained_requests_are_the_same_bits_beside_constrained_ones(llm):
    free = [SamplingParams(seed=s, max_tokens=40, logprobs=0) for s in (5, 6)]
    alone = llm.generate(["one", "two"], free, use_tqdm=False)
    mixed = llm.generate(["one", "x", "two", "y"], [free[0], constrained(1, json=SCHEMAS["numbers"]), free[1],
                                                    constrained(2, regex=REGEXES[0])], use_tqdm=False)
    for a, b in zip(alone, (mixed[0], mixed[2])):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.outputs[0].token_logprobs] == [lp.logprob for lp in b.outputs[0].token_logprobs]
    check(mixed[1], {"json": SCHEMAS["numbers"]})


@pytest.mark.parametrize("spec, field, why", [
    (dict(grammar="root ::= 'a'"), "structured_outputs", "context-free grammars are not supported"),
    (dict(json={"type": "integer", "minimum": 3}), "structured_outputs", "'minimum' is not supported"),
    (dict(json={"oneOf": [{"type": "integer"}]}), "structured_outputs", "'oneOf' is not supported"),
    (dict(regex="(unclosed"), "structured_outputs", "cannot be built"),
    (dict(json={"enum": []}), "structured_outputs", "enum must be a non-empty list"),
    (dict(json='{"items":' * 2000 + "{}" + "}" * 2000), "structured_outputs", "nests too deep"),
    (dict(choice=["abc"], max_tokens=1), "max_tokens", "too small for the structured output"),
    # refused from the request, before a build of 100,000 states
    (dict(json={"type": "string", "minLength": 100_000}), "max_tokens", "at least 100002 characters"),
    (dict(regex="a{100000}"), "max_tokens", "at least 100000 characters"),
])
def test_what_cannot_be_guaranteed_is_refused(llm, spec, field, why):
    max_tokens = spec.pop("max_tokens", 16)
    with pytest.raises(ValueError, match=why) as e:
        llm.generate("x", constrained(0, max_tokens=max_tokens, **spec), use_tqdm=False)
    assert e.value.field == field


def test_end_tokens_must_be_special(llm):
    with pytest.raises(ValueError, match="ignore_eos leaves none"):
        llm.generate("x", SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=["a"])),
                     use_tqdm=False)
    content = llm.tokenizer.token_to_id("a")
    with pytest.raises(ValueError, match="may contain"):
        llm.generate("x", SamplingParams(stop_token_ids=[content], structured_outputs=StructuredOutputsParams(choice=["a"])),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={}, regex="a")


def test_two_ranks(json_tiny, single_threaded_workers):
    specs = [{"json": SCHEMAS["nested"]}, {"json": SCHEMAS["array_enum"]}, {"regex": REGEXES[1]}, {"choice": CHOICES}]
    with LLM(json_tiny, tensor_parallel_size=2, max_model_len=256) as llm:
        outs = llm.generate(["Write it:"] * 4, [constrained(seed, max_tokens=48, **spec) for seed, spec in enumerate(specs)],
                            use_tqdm=False)
    for out, spec in zip(outs, specs):
        check(out, spec)


@pytest.mark.slow
def test_static_compiled_step(json_tiny):
    """The static canvas step (torch.compile'd) hands back its distribution for the constrained commit."""
    specs = [{"json": SCHEMAS["nested"]}, {"regex": REGEXES[0]}]
    with LLM(json_tiny, max_model_len=256, compile=True) as llm:
        outs = llm.generate(["a", "b", "c", "d"], [constrained(seed, **spec) for spec in specs for seed in (0, 1)],
                            use_tqdm=False)
    for i, out in enumerate(outs):
        check(out, specs[i // 2])


def test_forced_tool_call_arguments_in_the_gemma_format():
    """A forced call's constraint on the demo model (whose tokenizer has the Gemma 4 markers): every
    output is calls that the Gemma 4 parser reads, each call's arguments valid under its tool's
    schema, nested objects, arrays, numbers, booleans, enums and optional keys included."""
    from blockdiff.entrypoints.openai.protocol import Tool
    from blockdiff.entrypoints.openai.structured import tool_call_constraint
    from blockdiff.entrypoints.openai.tool_parsers import Gemma4ToolParser

    params = {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "units": {"enum": ["C", "F"]}, "hours": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "tag": {"type": ["string", "null"]}},
                  "required": ["lat"]},
    }, "required": ["city", "days", "where"]}
    tools = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": params}})
             for n in ("forecast", "alerts")]
    spec = tool_call_constraint(tools, frozenset({"forecast", "alerts"}), parallel=True)
    with LLM() as llm:
        outs = llm.chat([[{"role": "user", "content": q}] for q in ("weather in Rome", "sort: 3 1 2", "hi")],
                        [SamplingParams(seed=s, max_tokens=120, skip_special_tokens=False, structured_outputs=spec)
                         for s in range(3)], use_tqdm=False)
    for out in outs:
        parser = Gemma4ToolParser()
        parsed = parser.feed(out.text.removesuffix("<end_of_turn>"), final=True)
        assert parsed.calls and not parsed.content.strip() and not parser.malformed, out.text
        for call in parsed.calls:
            assert call.name in ("forecast", "alerts")
            jsonschema.validate(call.arguments, params)


@pytest.mark.slow  # the build alone takes ~16 s on a quiet 2-core Xeon
def test_a_choice_of_two_thousand_long_strings_builds_and_is_followed():
    """2,048 choices of 120 letters (a byte DFA of 241,082 states) within the build's bounds (60 s,
    2 GiB): the output is one of them."""
    import random
    import string

    rng = random.Random(0)
    choices = ["".join(rng.choice(string.ascii_lowercase) for _ in range(120)) for _ in range(2048)]
    with LLM(structured_outputs_timeout=60) as llm:
        [out] = llm.generate(["pick: "], SamplingParams(max_tokens=128, max_denoising_steps=2, structured_outputs=
                                                        StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert out.outputs[0].text in choices


# (a constraint, the fewest characters the length bound reads from it)
LENGTHS = [
    (dict(json={"type": "string", "minLength": 5}), 7),
    (dict(json={"type": "array", "minItems": 3, "items": {"type": "integer"}}), 7),
    (dict(json={"type": "object", "properties": {"k": {"type": "string", "minLength": 2}, "n": {"type": "null"}},
                "required": ["k"]}), 10),
    (dict(json={"$defs": {"s": {"type": "string", "minLength": 4}}, "anyOf": [{"$ref": "#/$defs/s"}, {"type": "boolean"}]}),
     4),
    (dict(regex="a{20}(b|cd)?"), 20),
    (dict(choice=["abc", "de"]), 2),
]


def test_the_length_bound_is_at_most_the_shortest_output():
    """On the demo vocabulary, whose tokens are single bytes, an automaton's fewest tokens are its
    fewest bytes, so at least its fewest characters: the bound read from the request never exceeds
    them (it would refuse a request that can be served), and is what it should be where known."""
    tokenizer = Tokenizer.from_pretrained(demo_checkpoint())
    assert longest_token(tokenizer) == 1
    structured = StructuredOutputs(tokenizer, tokenizer.vocab_size, timeout=60, memory=2**31, builds=1)
    try:
        cases = [*LENGTHS, *((dict(json=s), None) for s in SCHEMAS.values()), *((dict(regex=r), None) for r in REGEXES),
                 (dict(choice=CHOICES), None)]
        for spec, want in cases:
            params = StructuredOutputsParams(**spec)
            bound = min_chars(params)
            assert want is None or bound == want, (spec, bound)
            assert 0 < bound <= tokens_needed(structured.automaton(params)), spec
    finally:
        structured.close()
