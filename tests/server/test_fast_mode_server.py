"""The fast denoising mode through the real server on the demo checkpoint, with the official openai
client: `--denoising-mode fast` as the server's default and `denoising_mode` per request in the
extra body; a streamed chat's text equals the same request's text not streamed, and arrives in
more pieces than it has canvases where the settled prefix streams early; usage counts the rows the
model ran; a bad value is a 400 naming the field."""

from __future__ import annotations

import openai
import pytest
from server_process import serve

CL = 8  # the demo's canvas length
SORT = "sort: 3 3 3 1 1 2 2 9 9 9 5 5 4 4 8 8 7 6 6 2"
# warm sampling and no early stop, so that canvases run several steps and positions settle apart
WARM = dict(t_min=0.3, t_max=0.6, confidence_threshold=0.0, max_denoising_steps=8, settle_steps=1)

server = serve(None, "--max-model-len", "256", "--max-num-seqs", "4", "--denoising-mode", "fast")


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(server, stream: bool, seed: int, **extra):
    return _client(server).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": SORT}], max_tokens=40, seed=seed, stream=stream,
        extra_body={**WARM, **extra}, **({"stream_options": {"include_usage": True}} if stream else {}))


def test_a_streamed_chat_gives_the_text_of_the_same_chat_not_streamed(server):
    early = 0
    for seed in range(4):
        whole = _chat(server, False, seed)
        chunks = list(_chat(server, True, seed))
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta and c.choices[0].delta.content]
        assert "".join(pieces) == whole.choices[0].message.content
        canvases = whole.usage.model_extra["diffusion"]["canvases"]
        early += len(pieces) > canvases  # some text came before its canvas ended
        usage = whole.usage.model_extra["diffusion"]
        assert usage["canvas_positions_evaluated"] <= usage["denoising_steps"] * CL
        assert chunks[-1].usage.model_extra["diffusion"] == usage
    assert early, "no chat streamed a settled prefix before its canvas ended: the test proves nothing"


def test_the_server_default_and_a_request_that_asks_for_the_exact_mode(server):
    fast = _chat(server, False, 7).usage.model_extra["diffusion"]
    exact = _chat(server, False, 7, denoising_mode="exact").usage.model_extra["diffusion"]
    assert exact["canvas_positions_evaluated"] == exact["denoising_steps"] * CL
    assert fast["canvas_positions_evaluated"] < fast["denoising_steps"] * CL  # the server's default: fast


@pytest.mark.parametrize("field,value", [("denoising_mode", "quick"), ("settle_steps", 0), ("settle_entropy", -1.0)])
def test_a_bad_value_is_a_400_naming_the_field(server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, False, 0, **{field: value})
    assert field in str(e.value)
    assert _chat(server, False, 0).choices[0].message.content is not None  # still up
