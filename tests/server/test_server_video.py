"""Videos through the OpenAI server: video_url chat requests with the official client equal to the
offline API (a data: URL and a file under --allowed-local-media-path), and a 4K video of 1,000
frames refused from its header with a 400 naming the limit while /health stays fast."""

from __future__ import annotations

import base64
import threading

import httpx
import openai
import pytest
from server_process import HealthProbe, fixture_value, serve
from test_video import VISION_SPEC, claimed_video, clip

from blockdiff import LLM, SamplingParams
from blockdiff.model.tiny import VIDEO

STEPS = 4
MODEL = "mm"


def _data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _concurrently(server, messages, requests: int) -> list[httpx.Response]:
    out: list = [None] * requests

    def chat(i: int) -> None:
        out[i] = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=300)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _messages(*parts: dict, text: str = "What happens?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def _video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


@pytest.fixture(scope="module")
def mm(checkpoints) -> str:
    return checkpoints("vision", **VISION_SPEC)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("videos")


server = serve(fixture_value("mm"), "--served-model-name", MODEL, "--max-denoising-steps", str(STEPS), "--max-model-len",
               "512", "--allowed-local-media-path", fixture_value("files"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_video_url_chat_equals_offline(mm, files, client):
    data = clip(3)
    (files / "clip.mp4").write_bytes(data)
    messages = _messages(_video_part(_data_url(data, "video/mp4")))
    with LLM(mm) as llm:
        [want] = llm.chat(messages, SamplingParams(max_tokens=16, seed=8, max_denoising_steps=STEPS), use_tqdm=False)
    assert want.prompt_token_ids.count(VIDEO) == 3 * 70  # three sampled frames of 70 soft tokens

    for url in (_data_url(data, "video/mp4"), f"file://{files / 'clip.mp4'}"):
        r = client.chat.completions.create(model=MODEL, messages=_messages(_video_part(url)), max_completion_tokens=16,
                                           seed=8, extra_body={"return_token_ids": True})
        assert r.choices[0].token_ids == want.token_ids
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("url, says", [
    (_data_url(b"not a video", "video/mp4"), "is not a video in a format FFmpeg reads"),
    (_data_url(b"\x89PNG", "image/png"), "a data URL of type 'image/png' is not a video"),
    ("https://example.org/clip.mp4", "--allowed-media-domains"),
])
def test_bad_video_urls_are_400s_naming_the_problem(client, url, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_messages(_video_part(url)), max_tokens=4)
    assert says in e.value.body["message"] and e.value.body["code"] == "invalid_video", e.value.body


def test_two_videos_are_above_the_default_limit(client):
    url = _data_url(clip(4), "video/mp4")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_messages(_video_part(url), _video_part(url)), max_tokens=4)
    assert "2 videos in one prompt, above the limit of 1 (--limit-mm-per-prompt)" in e.value.body["message"]
    assert e.value.body["code"] == "invalid_video"


def test_a_4k_video_of_1000_frames_is_refused_from_its_header(server):
    """57 kB sent, 8.3 G pixels to decode: refused from its header before any frame is decoded, four
    requests at once, /health answering. (Before the bound, each was decoded, 1,000 4K frames.)"""
    big = claimed_video(3840, 2160, 1000)
    with HealthProbe(server) as probe:
        responses = _concurrently(server, _messages(_video_part(_data_url(big, "video/mp4"))), 4)
    print(f"4K x 1000: {[r.status_code for r in responses]}, {probe}")
    for r in responses:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_video"
        assert ("(1000 frames of 3840x2160) is 8294400000 pixels to decode, above the limit of 2147483648 "
                "(--max-video-pixels)") in error["message"]
    probe.check()
    assert probe.worst < 1.0


def test_a_long_video_under_the_bounds_is_decoded_in_the_pool_while_health_answers(server):
    """900 frames of 1080p (1.9 G pixels, under --max-video-pixels): every frame up to the last one
    sampled is decoded, in the decode pool, while /health keeps answering."""
    long = claimed_video(1920, 1080, 900)
    with HealthProbe(server) as probe:
        responses = _concurrently(server, _messages(_video_part(_data_url(long, "video/mp4"))), 2)
    print(f"1080p x 900: {[r.status_code for r in responses]}, {probe}")
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    probe.check()
    assert probe.worst < 1.0
