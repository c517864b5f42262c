"""The demo model's character-level tokenizer and chat template.

Ids: the special tokens of the tiny model, then one token per printable ASCII character and the
newline, then the Gemma 4 agent markers (tool declarations, calls, responses, string quotes,
thinking), each a single special token. Appending the markers kept every earlier id, so the model
trained before they existed could grow its embedding instead of starting again.

The chat template keeps the tiny model's turns (`<start_of_turn>ROLE\\n...<end_of_turn>\\n`) and adds
the Gemma 4 agent format: a system turn with `<|think|>` and `<|tool>declaration:...<tool|>` when
thinking is on or tools are given, calls `<|tool_call>call:NAME{key:<|"|>value<|"|>}<tool_call|>`
inside the model's turn, tool results `<|tool_response>response:NAME{value:...}<tool_response|>`
right after them in the same turn (the model then goes on in that turn), and thoughts
`<|channel>thought\\n...<channel|>` dropped from earlier replies.
"""

from __future__ import annotations

import json
import os
import string

from blockdiff.model.tiny import SPECIAL_TOKENS, TOKENIZER_CONFIG

CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII and "\n"
AGENT_TOKENS = [
    "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
    '<|"|>', "<|channel>", "<channel|>", "<|think|>",
]
VOCAB = [*SPECIAL_TOKENS, *CHARACTERS, *AGENT_TOKENS]

CHAT_TEMPLATE = """\
{%- macro format_argument(value) -%}
    {%- if value is string -%}
        {{- '<|"|>' + value + '<|"|>' -}}
    {%- elif value is boolean -%}
        {{- 'true' if value else 'false' -}}
    {%- elif value is mapping -%}
        {{- '{' -}}
        {%- for key, item in value | dictsort -%}
            {{- key + ':' + format_argument(item) -}}{{- ',' if not loop.last -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif value is sequence -%}
        {{- '[' -}}
        {%- for item in value -%}
            {{- format_argument(item) -}}{{- ',' if not loop.last -}}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- value | string -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {{- (text.split('<channel|>') | last if '<channel|>' in text else text) | trim -}}
{%- endmacro -%}
{{- bos_token -}}
{%- if tools or enable_thinking -%}
    {{- '<start_of_turn>system\\n' -}}
    {%- if enable_thinking -%}{{- '<|think|>' -}}{%- endif -%}
    {%- for tool in tools or [] -%}
        {%- set function = tool['function'] -%}
        {%- set properties = (function['parameters'] or {}).get('properties') or {} -%}
        {{- '<|tool>declaration:' + function['name'] + '{description:' + format_argument(function['description'] or '') -}}
        {{- ',parameters:{' -}}
        {%- for key, schema in properties | dictsort -%}
            {{- key + ':' + format_argument(schema['type'] | upper) -}}{{- ',' if not loop.last -}}
        {%- endfor -%}
        {{- '}}<tool|>' -}}
    {%- endfor -%}
    {{- '<end_of_turn>\\n' -}}
{%- endif -%}
{%- set ns = namespace(open=false) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'tool' -%}
        {%- if not ns.open -%}
            {{- raise_exception('a tool message must follow an assistant message with tool_calls') -}}
        {%- endif -%}
        {%- set called = namespace(name=message.get('name') or 'unknown') -%}
        {%- for earlier in messages[:loop.index0] -%}
            {%- for call in earlier.get('tool_calls') or [] -%}
                {%- if call.get('id') == message.get('tool_call_id') -%}
                    {%- set called.name = call['function']['name'] -%}
                {%- endif -%}
            {%- endfor -%}
        {%- endfor -%}
        {{- '<|tool_response>response:' + called.name + '{value:' + format_argument(message['content']) + '}<tool_response|>' -}}
    {%- else -%}
        {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {%- if ns.open and role != 'model' -%}
            {{- '<end_of_turn>\\n' -}}
        {%- endif -%}
        {%- if not (ns.open and role == 'model') -%}
            {{- '<start_of_turn>' + role + '\\n' -}}
        {%- endif -%}
        {%- set ns.open = false -%}
        {%- for call in message.get('tool_calls') or [] -%}
            {%- set function = call['function'] -%}
            {{- '<|tool_call>call:' + function['name'] + '{' -}}
            {%- if function['arguments'] is mapping -%}
                {%- for key, value in function['arguments'] | dictsort -%}
                    {{- key + ':' + format_argument(value) -}}{{- ',' if not loop.last -}}
                {%- endfor -%}
            {%- else -%}
                {{- function['arguments'] -}}
            {%- endif -%}
            {{- '}<tool_call|>' -}}
            {%- set ns.open = true -%}
        {%- endfor -%}
        {%- if message['content'] is string -%}
            {{- strip_thinking(message['content']) if role == 'model' else message['content'] | trim -}}
        {%- endif -%}
        {%- if not ns.open -%}
            {{- '<end_of_turn>\\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.open -%}
    {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

TOKENIZER_CONFIG_DEMO = {**TOKENIZER_CONFIG, "chat_template": CHAT_TEMPLATE}


def build_char_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models

    # BPE without merges: every character is its own token, anything else is <unk>.
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + AGENT_TOKENS])
    tok.decoder = decoders.Fuse()
    return tok


def save_char_tokenizer(out_dir: str) -> None:
    """tokenizer.json, and tokenizer_config.json with the special tokens and the demo's chat template."""
    build_char_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG_DEMO, f, indent=2)
