"""Chat-template rendering: blockdiff's (blockdiff/tokenizer.py) against transformers'
apply_chat_template, the oracle, on the demo tokenizer with its Gemma-4-format template and on a
Gemma-4-style template written here; same text and same ids for tools, tool calls, tool results,
thinking on and off."""

from __future__ import annotations

import pytest

from blockdiff.demo.tasks import WEATHER_TOOL
from blockdiff.demo.tokenizer import CHAT_TEMPLATE, save_char_tokenizer
from blockdiff.tokenizer import Tokenizer

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time; \"tz\" <optional> & more",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "tz": {"type": "string", "enum": ["utc", "local"]}}},
    },
}

# Every variable below is read by both templates.
CONVERSATIONS = {
    "plain": dict(messages=[{"role": "user", "content": "sort: 3 1 2"}]),
    "system": dict(messages=[{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"}]),
    "tools": dict(messages=[{"role": "user", "content": "weather in Paris"}], tools=[WEATHER_TOOL, TIME_TOOL]),
    "tool_result": dict(
        messages=[
            {"role": "user", "content": "weather in Paris"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris", "n": 2, "ok": True, "xs": [1, "a"]}}},
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "18C sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "10:00"},
        ],
        tools=[WEATHER_TOOL, TIME_TOOL],
    ),
    "answered_then_new_turn": dict(
        messages=[
            {"role": "user", "content": "weather in Oslo"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "2C snowy"},
            {"role": "assistant", "content": "Oslo: 2C snowy"},
            {"role": "user", "content": "thanks"},
        ],
        tools=[WEATHER_TOOL],
    ),
    "thought_before_call": dict(  # under vLLM's newer name, which transformers reads as reasoning_content too
        messages=[
            {"role": "user", "content": "weather in Rome"},
            {"role": "assistant", "reasoning": "I call the tool.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "20C sunny"},
        ],
        tools=[WEATHER_TOOL],
        enable_thinking=True,
    ),
    "thinking_on": dict(messages=[{"role": "user", "content": "sort: 3 1 2"}], enable_thinking=True),
    "thinking_off": dict(messages=[{"role": "user", "content": "sort: 3 1 2"}], enable_thinking=False),
    "thought_in_history": dict(
        messages=[
            {"role": "user", "content": "sort: 2 1"},
            {"role": "assistant", "content": "<|channel>thought\nI sort the digits.<channel|>1 2", "reasoning_content": "I sort the digits."},
            {"role": "user", "content": "upper: ab"},
        ],
        enable_thinking=True,
    ),
}

# A Gemma-4-style template (Gemma 4's turn markers and formats) that uses the helpers real
# templates use: namespace, dictsort, tojson with options, strftime_now, raise_exception, dict.
GEMMA4_STYLE = """\
{%- macro arg(value, quote_keys=false) -%}
    {%- if value is string -%}{{- '<|"|>' + value + '<|"|>' -}}
    {%- elif value is boolean -%}{{- 'true' if value else 'false' -}}
    {%- elif value is mapping -%}{{- '{' -}}
        {%- for k, v in value | dictsort -%}{{- ('<|"|>' + k + '<|"|>' if quote_keys else k) + ':' + arg(v, quote_keys) -}}{{- ',' if not loop.last -}}{%- endfor -%}{{- '}' -}}
    {%- elif value is sequence -%}{{- '[' -}}{%- for v in value -%}{{- arg(v, quote_keys) -}}{{- ',' if not loop.last -}}{%- endfor -%}{{- ']' -}}
    {%- else -%}{{- value -}}{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set opts = dict(sep=', ') -%}
{%- if enable_thinking is defined and enable_thinking or tools or messages[0]['role'] == 'system' -%}
    {{- '<|turn>system\\n' -}}
    {%- if enable_thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}
    {%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] | trim -}}{%- endif -%}
    {%- for tool in tools or [] -%}
        {{- '<|tool>declaration:' + tool['function']['name'] + arg(tool['function'], true) + '<tool|>' -}}
        {{- '<!--' + (tool['function']['parameters'] | tojson(indent=1, separators=(',', ': '), sort_keys=true)) + '-->' -}}
    {%- endfor -%}
    {{- '\\nToday: ' + strftime_now('%Y-%m-%d') + '<turn|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(open=false, last_user=-1) -%}
{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
    {%- if m['role'] == 'system' -%}
        {%- if not loop.first -%}{{- raise_exception('system messages must come first') -}}{%- endif -%}
    {%- elif m['role'] == 'tool' -%}
        {%- set found = namespace(name='unknown') -%}
        {%- for earlier in messages[:loop.index0] -%}{%- for c in earlier.get('tool_calls') or [] -%}
            {%- if c['id'] == m['tool_call_id'] -%}{%- set found.name = c['function']['name'] -%}{%- endif -%}
        {%- endfor -%}{%- endfor -%}
        {{- '<|tool_response>response:' + found.name + '{value:' + arg(m['content']) + '}<tool_response|>' -}}
    {%- else -%}
        {%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
        {%- if not (ns.open and role == 'model') -%}{{- '<|turn>' + role + '\\n' -}}{%- endif -%}
        {%- set ns.open = false -%}
        {%- set thinking = m.get('reasoning_content') -%}
        {%- if thinking and loop.index0 > ns.last_user -%}{{- '<|channel>thought\\n' + thinking + '<channel|>' -}}{%- endif -%}
        {%- for c in m.get('tool_calls') or [] -%}
            {{- '<|tool_call>call:' + c['function']['name'] + arg(c['function']['arguments']) + '<tool_call|>' -}}
            {%- set ns.open = true -%}
        {%- endfor -%}
        {%- if m['content'] is string or not m['content'] -%}
            {%- set text = m['content'] or '' -%}
            {{- (text.split('<channel|>') | last if role == 'model' else text) | trim -}}
        {%- else -%}{%- for part in m['content'] -%}
            {%- if part['type'] == 'image' -%}{{- '\\n\\n<|image|>\\n\\n' -}}
            {%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}
        {%- endfor -%}{%- endif -%}
        {%- if not ns.open -%}{{- '<turn|>\\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.open -%}{{- '<|turn>model\\n' -}}{%- endif -%}
"""


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("demo-tokenizer")
    save_char_tokenizer(str(out))
    return str(out)


@pytest.fixture(scope="module", params=["demo", "gemma4_style"])
def pair(request, tokenizer_dir):
    """(blockdiff's tokenizer, transformers' tokenizer), the same files and template."""
    from transformers import AutoTokenizer

    template = CHAT_TEMPLATE if request.param == "demo" else GEMMA4_STYLE
    ours = Tokenizer.from_pretrained(tokenizer_dir, chat_template=template)
    theirs = AutoTokenizer.from_pretrained(tokenizer_dir)
    theirs.chat_template = template
    return ours, theirs


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_rendering_and_ids_match_transformers(pair, name):
    ours, theirs = pair
    conversation = dict(CONVERSATIONS[name])
    messages = conversation.pop("messages")
    text = ours.apply_chat_template(messages, **conversation)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **conversation)
    ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False, **conversation)
    assert ours.encode_chat(messages, **conversation) == list(ids)


def test_demo_template_shapes(tokenizer_dir):
    """The demo template keeps the earlier prompts exactly and writes the agent parts as single tokens."""
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    plain = tok.apply_chat_template(CONVERSATIONS["plain"]["messages"])
    assert plain == "<bos><start_of_turn>user\nsort: 3 1 2<end_of_turn>\n<start_of_turn>model\n"
    result = tok.apply_chat_template(**CONVERSATIONS["tool_result"])
    assert result.endswith('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                           '<|tool_call>call:get_time{city:<|"|>Paris<|"|>,n:2,ok:true,xs:[1,<|"|>a<|"|>]}<tool_call|>'
                           '<|tool_response>response:get_weather{value:<|"|>18C sunny<|"|>}<tool_response|>'
                           '<|tool_response>response:get_time{value:<|"|>10:00<|"|>}<tool_response|>')
    ids = tok.encode_chat(CONVERSATIONS["tool_result"]["messages"], tools=[WEATHER_TOOL])
    assert tok.token_to_id("<|tool_call>") in ids and tok.token_to_id('<|"|>') in ids
    assert "<|think|>" in tok.apply_chat_template(**CONVERSATIONS["thinking_on"])
    assert "<|think|>" not in tok.apply_chat_template(**CONVERSATIONS["thinking_off"])


def test_template_variables(tokenizer_dir):
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    # Names the template sets itself (role, called, ns) or takes from jinja (namespace, loop) are not its variables.
    assert tok.template_variables == {"add_generation_prompt", "bos_token", "enable_thinking", "messages", "tools"}


def test_template_errors_are_value_errors(tokenizer_dir):
    tok = Tokenizer.from_pretrained(tokenizer_dir, chat_template=GEMMA4_STYLE)
    with pytest.raises(ValueError, match="system messages must come first"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
# Conversations with images in OpenAI's format, as a client sends them.
IMAGE_CONVERSATIONS = {
    "one_image": [{"role": "user", "content": [{"type": "text", "text": "what is this? "}, {"type": "image_url", "image_url": {"url": PIXEL}}]}],
    "two_images_two_turns": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PIXEL}}, {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": PIXEL}]},
        {"role": "assistant", "content": "two pixels"},
        {"role": "user", "content": [{"type": "text", "text": " compare "}, {"type": "image_url", "image_url": {"url": PIXEL}}]},
    ],
    "image_only": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PIXEL}}]}],
}


@pytest.fixture(scope="module", params=["gemma4_style", "tiny_vision"])
def image_pair(request, tmp_path_factory, tokenizer_dir):
    """(blockdiff's tokenizer, transformers' tokenizer) of a template that renders image parts: the
    Gemma-4-style one on the demo tokenizer, and make-tiny-model --vision's with its image tokens."""
    from transformers import AutoTokenizer

    from blockdiff.model.tiny import write_tokenizer

    if request.param == "gemma4_style":
        path, template = tokenizer_dir, GEMMA4_STYLE
    else:
        path, template = str(tmp_path_factory.mktemp("vision-tokenizer")), None
        write_tokenizer(path, 300, vision=True)
    ours = Tokenizer.from_pretrained(path, chat_template=template)
    theirs = AutoTokenizer.from_pretrained(path)
    theirs.chat_template = ours.chat_template
    return ours, theirs


@pytest.mark.parametrize("name", IMAGE_CONVERSATIONS)
def test_image_conversations_match_transformers(image_pair, name):
    """The messages blockdiff's chat path renders (image parts split off by split_chat_media, the one
    the server and LLM.chat use) give the text and ids transformers renders from the same conversation."""
    from blockdiff.chat_parts import MediaPolicy, fetch_url, split_chat_media

    ours, theirs = image_pair
    messages = IMAGE_CONVERSATIONS[name]
    rendered, media = split_chat_media(messages, lambda url, what, modality: fetch_url(url, MediaPolicy(), 1 << 20, what))
    images = media.get("image", [])
    assert len(images) == sum(isinstance(m["content"], list) and sum(p["type"] == "image_url" for p in m["content"]) for m in messages)
    assert all(image.startswith(b"\x89PNG") for image in images)
    # transformers' template reads an image part as {"type": "image"}, as Gemma 4's processor passes it
    oracle = [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
              if isinstance(m["content"], list) else m for m in messages]
    text = ours.apply_chat_template(rendered)
    assert text == theirs.apply_chat_template(oracle, tokenize=False, add_generation_prompt=True)
    assert text.count("image") >= len(images)
    ids = theirs.apply_chat_template(oracle, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(rendered) == list(ids)
