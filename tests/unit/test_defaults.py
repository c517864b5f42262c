"""Generation defaults that match the real checkpoint: EOS ids from the top-level config.json when
generation_config.json has none, and an unset max_tokens that takes what fits in the context."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
from server_process import ServerProcess

from blockdiff import LLM, SamplingParams

GREEDY = dict(t_min=1e-6, t_max=2e-6, max_denoising_steps=4)  # few steps: the canvases only need to exist
PROMPTS = [[2, 17, 40, 99], [2, 5, 6, 7, 8], [2, 120, 33], [2, 250, 251, 252], [2, 9], [2, 77, 78, 79, 80, 81]]


def _edit(path: str, name: str, change) -> None:
    file = os.path.join(path, name)
    with open(file) as f:
        data = json.load(f)
    change(data)
    with open(file, "w") as f:
        json.dump(data, f)


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_the_top_level_eos_list_stops_generation_on_each_of_its_ids(tiny, tmp_path):
    with LLM(tiny) as llm:
        free = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY))]
    # Two prompts whose outputs start with different tokens: each output ends at its first token
    # only if that token is an EOS id.
    i = 0
    j = next(k for k in range(1, len(PROMPTS)) if free[k][0] != free[0][0])
    eos = [free[i][0], free[j][0]]
    path = _copy(tiny, tmp_path / "top-level-eos")
    _edit(path, "config.json", lambda c: (c.update(eos_token_id=eos), c["text_config"].pop("eos_token_id")))
    _edit(path, "generation_config.json", lambda g: g.pop("eos_token_id"))
    with LLM(path) as llm:
        outs = llm.generate([PROMPTS[i], PROMPTS[j]], SamplingParams(max_tokens=8, **GREEDY))
    for out, want in zip(outs, eos):
        assert (out.token_ids, out.finish_reason) == ([want], "stop")


def test_the_top_level_eos_list_gives_way_to_generation_config(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "both")
    _edit(path, "config.json", lambda c: c.update(eos_token_id=[7, 8]))
    _edit(path, "generation_config.json", lambda g: g.update(eos_token_id=9))
    with LLM(path) as llm:
        assert llm.engine.inputs.eos_token_ids == (9,)


@pytest.fixture(scope="module")
def short_default(tiny, tmp_path_factory) -> str:
    """The tiny checkpoint with generation_config.json's max_new_tokens at 8, one canvas."""
    path = _copy(tiny, tmp_path_factory.mktemp("short") / "ckpt")
    _edit(path, "generation_config.json", lambda g: g.update(max_new_tokens=8))
    return path


PROMPT = [2, 17, 40, 99]
MAX_MODEL_LEN = 4 + 3 * 8 + 5  # room for three canvases and a cut one


def test_unset_max_tokens_takes_what_fits_in_the_context_offline(short_default):
    with LLM(short_default, max_model_len=MAX_MODEL_LEN) as llm:
        out, = llm.generate([PROMPT], SamplingParams(ignore_eos=True, **GREEDY))
    assert (len(out.token_ids), out.finish_reason) == (MAX_MODEL_LEN - len(PROMPT), "length")


def test_unset_max_tokens_takes_what_fits_in_the_context_through_the_server(short_default, tmp_path):
    server = ServerProcess(short_default, "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny",
                           log_path=str(tmp_path / "server.log"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        extra = {"ignore_eos": True, **GREEDY}
        done = client.completions.create(model="tiny", prompt=PROMPT, extra_body=extra)
        assert done.usage.completion_tokens == MAX_MODEL_LEN - len(PROMPT) and done.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], extra_body=extra)
        room = MAX_MODEL_LEN - chat.usage.prompt_tokens
        assert room > 8 and chat.usage.completion_tokens == room and chat.choices[0].finish_reason == "length"
    finally:
        server.close()
