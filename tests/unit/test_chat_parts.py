"""Chat image parts are read at the edge (blockdiff/chat_parts.py): `LLM.chat` fetches an image URL
under its own media policy (the engine flags --allowed-local-media-path, ...), and gives the engine
the image's bytes, so a file:// URL and a data: URL of the same file generate the same tokens."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from blockdiff import LLM, SamplingParams
from blockdiff.chat_parts import MediaPolicy, fetch_url
from blockdiff.multimodal import MediaError

VISION_SPEC = dict(vocab_size=301, canvas_length=8, sliding_window=6, seed=3, vision=True)


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 256, (16, 24, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]


def test_llm_chat_fetches_file_urls_only_where_allowed(checkpoints, tmp_path):
    model = checkpoints("vision", **VISION_SPEC)
    data = _png(4)
    (tmp_path / "a.png").write_bytes(data)
    params = SamplingParams(max_tokens=8, seed=2, max_denoising_steps=4)
    with LLM(model, allowed_local_media_path=str(tmp_path)) as llm:
        [by_file] = llm.chat(_chat(f"file://{tmp_path}/a.png"), params, use_tqdm=False)
        [by_data] = llm.chat(_chat("data:image/png;base64," + base64.b64encode(data).decode()), params, use_tqdm=False)
    assert by_file.token_ids == by_data.token_ids and by_file.prompt_token_ids == by_data.prompt_token_ids
    with LLM(model) as llm, pytest.raises(MediaError, match="--allowed-local-media-path"):
        llm.chat(_chat(f"file://{tmp_path}/a.png"), params, use_tqdm=False)


def test_fetch_url_policy(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(1))
    allowed = MediaPolicy(local_path=str(tmp_path))
    assert fetch_url(f"file://{tmp_path}/a.png", allowed, 1 << 20) == _png(1)
    with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
        fetch_url(f"file://{tmp_path}/../a.png", allowed, 1 << 20)
    with pytest.raises(MediaError, match="--allowed-media-domains example.org"):
        fetch_url("https://example.org/a.png", MediaPolicy(), 1 << 20)
    with pytest.raises(MediaError, match="above the limit"):
        fetch_url(f"file://{tmp_path}/a.png", allowed, 10)
