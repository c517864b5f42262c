"""Images through the OpenAI server: image_url chat requests with the official client (streaming
and not, equal to the offline API), and the table of bad image input, each a 400 naming the problem."""

from __future__ import annotations

import base64
import io
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from server_process import ServerProcess, fixture_value, serve

from blockdiff import LLM, SamplingParams
from blockdiff.model.tiny import IMAGE

STEPS = 4
MODEL = "mm"
VISION_SPEC = dict(vocab_size=301, canvas_length=8, sliding_window=6, seed=3, vision=True)


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _picture(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _messages(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


@pytest.fixture(scope="module")
def mm(checkpoints) -> str:
    return checkpoints("vision", **VISION_SPEC)


server = serve(
    fixture_value("mm"), "--served-model-name", MODEL, "--max-denoising-steps", str(STEPS), "--max-model-len", "512",
    "--limit-mm-per-prompt", '{"image": 2}', "--max-image-bytes", "40KiB", "--max-image-pixels", "100000",
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_image_url_chat_equals_offline_streaming_and_not(mm, client):
    a, b = _png(_picture(30, 20, 1)), _png(_picture(12, 40, 2))
    messages = _messages(_data_url(a), _data_url(b))
    with LLM(mm, limit_images_per_prompt=2) as llm:
        [want] = llm.chat(messages, SamplingParams(max_tokens=16, seed=8, max_denoising_steps=STEPS), use_tqdm=False)
    assert want.prompt_token_ids.count(IMAGE) > 2  # the images' soft tokens are in the prompt

    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, seed=8,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == want.token_ids
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)  # the images' tokens counted

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, seed=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


def test_bad_images_are_400s_naming_the_problem_and_the_server_stays_up(mm, server, client, tmp_path):
    text_only = tmp_path / "text-only"
    shutil.copytree(mm, text_only)
    config = json.loads((text_only / "config.json").read_text())
    del config["vision_config"]
    (text_only / "config.json").write_text(json.dumps(config))
    ok = _data_url(_png(_picture(20, 20, 0)))
    noisy = _png(_picture(120, 120, 3))  # ~43 KB of noise: above --max-image-bytes 40KiB
    assert len(noisy) > 40 * 1024
    cases = [
        ("corrupt", server, _messages(_data_url(_png(_picture(20, 20, 0))[:200])), "corrupt"),
        ("format", server, _messages(_data_url(_png(_picture(20, 20, 0), "TIFF"), "image/tiff")), "unsupported format TIFF"),
        ("bytes", server, _messages(_data_url(noisy)), "above the limit of 40960"),
        ("pixels", server, _messages(_data_url(_png(Image.new("RGB", (400, 300))))), "120000 pixels, above the limit of 100000"),
        ("count", server, _messages(ok, ok, ok), "3 images in one prompt, above the limit of 2"),
        ("remote", server, _messages("https://example.com/cat.png"), "--allowed-media-domains example.com"),
        ("local", server, _messages(f"file://{tmp_path}/a.png"), "--allowed-local-media-path"),
        ("not-an-image", server, _messages("data:text/plain;base64," + base64.b64encode(b"hello").decode()),
         "type 'text/plain' is not an image"),
        ("audio", server, [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}],
         "messages[0].content[1]: 'input_audio' parts are not supported"),
        ("audio-beside-an-image", server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ok}},
                                                                         {"type": "input_audio"}]}],
         "messages[0].content[1]: 'input_audio' parts are not supported"),
        ("text-part-without-text", server, [{"role": "user", "content": [{"type": "text"}]}],
         "messages[0].content[0]: a 'text' part needs a string 'text' field"),
    ]
    text_server = ServerProcess(str(text_only), "--served-model-name", MODEL, log_path=str(tmp_path / "text.log"))
    try:
        cases.append(("no-vision-tower", text_server, _messages(ok), "does not take images: its checkpoint has no vision tower"))
        for name, where, messages, message in cases:
            r = httpx.post(where.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8},
                           timeout=60)
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert message in error["message"], (name, error)
            assert error["type"] == "invalid_request_error" and error["param"] == "messages", (name, error)
    finally:
        text_server.close()
    # still serving
    r = client.chat.completions.create(model=MODEL, messages=_messages(ok), max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length")
