"""A request's sampling parameters are resolved once and its image placeholders expanded once,
counted in the real server's processes (the front end and, with -dp 2, its replicas).

The count comes from a sitecustomize.py that this test puts on the server's PYTHONPATH: it wraps
`InputProcessor.resolve` and `MultiModalIntake.expand` in every process the server starts and appends one
line per call to a file. The product code has no hook for it."""

from __future__ import annotations

import base64
import io
import os
import textwrap

import numpy as np
import openai
import pytest
from PIL import Image
from server_process import fixture_value, serve

MODEL = "mm"
VISION_SPEC = dict(vocab_size=301, canvas_length=8, sliding_window=6, seed=3, vision=True)

SITECUSTOMIZE = textwrap.dedent('''
    import os

    def _counted(kind, fn, counts=lambda *args: True):
        path = os.environ["BLOCKDIFF_TEST_CALLS"]

        def wrapper(*args, **kwargs):
            if counts(*args):
                with open(path, "a") as f:
                    f.write(f"{kind} {os.getpid()}\\n")
            return fn(*args, **kwargs)

        return wrapper

    if os.environ.get("BLOCKDIFF_TEST_CALLS"):
        from blockdiff.engine.multimodal import MultiModalIntake
        from blockdiff.engine.input_processor import InputProcessor

        InputProcessor.resolve = _counted("resolve", InputProcessor.resolve)
        # Expanding placeholders for images; without any, expand only checks that the prompt has none.
        MultiModalIntake.expand = _counted("expand", MultiModalIntake.expand, lambda intake, ids, items: bool(items))
        MultiModalIntake.expand_text = _counted("expand", MultiModalIntake.expand_text,
                                                lambda intake, text, items, encode: bool(items))
''')


class Calls:
    def __init__(self, path: str):
        self.path = path
        self.mark()

    def _read(self) -> list[str]:
        with open(self.path) as f:
            return [line.split()[0] for line in f]

    def mark(self) -> None:
        """What the server did so far (its startup's own checks) is not counted."""
        self._seen = len(self._read()) if os.path.exists(self.path) else 0

    def since(self) -> dict[str, int]:
        """-> calls of each kind since the last mark (then marks again). Every call a request makes, in
        any process, is written before its response can be sent."""
        lines = self._read()
        new = lines[self._seen:]
        self._seen = len(lines)
        return {kind: new.count(kind) for kind in ("resolve", "expand")}


@pytest.fixture(scope="module")
def counting(tmp_path_factory) -> str:
    """A folder holding the counting sitecustomize.py; the calls go to calls.txt beside it."""
    where = tmp_path_factory.mktemp("resolve-once")
    (where / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(where)


server = serve(fixture_value("checkpoints", lambda checkpoints: checkpoints("vision", **VISION_SPEC)),
               "--served-model-name", MODEL, "--max-denoising-steps", "4", "--max-model-len", "256",
               "--data-parallel-size", lambda request: str(request.param), params=[1, 2], ids=["one-engine", "dp2"],
               env={"PYTHONPATH": fixture_value("counting", lambda where: os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))),
                    "BLOCKDIFF_TEST_CALLS": fixture_value("counting", lambda where: os.path.join(where, "calls.txt"))})


@pytest.fixture(scope="module")
def served(server, counting):
    calls = os.path.join(counting, "calls.txt")
    assert os.path.exists(calls), "the counting sitecustomize.py did not run in the server"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return client, Calls(calls)


def _image_url(seed: int) -> str:
    picture = Image.fromarray(np.random.RandomState(seed).randint(0, 256, (24, 20, 3), dtype=np.uint8))
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_resolves_once(served):
    client, calls = served
    calls.mark()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=1)
    assert calls.since() == {"resolve": 1, "expand": 0}


def test_streamed_chat_resolves_once(served):
    client, calls = served
    calls.mark()
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                        stream=True))
    assert calls.since() == {"resolve": 1, "expand": 0}


def test_completion_choices_share_one_resolution(served):
    """n=3 choices of one prompt: one resolution, not one per choice."""
    client, calls = served
    calls.mark()
    r = client.completions.create(model=MODEL, prompt="abc", n=3, max_tokens=8, seed=5)
    assert len(r.choices) == 3
    assert calls.since() == {"resolve": 1, "expand": 0}


def test_each_prompt_is_resolved_once_for_its_length(served):
    client, calls = served
    calls.mark()
    r = client.completions.create(model=MODEL, prompt=["abc", "a longer prompt"], n=2, max_tokens=8)
    assert len(r.choices) == 4
    assert calls.since() == {"resolve": 2, "expand": 0}


def test_scored_echo_resolves_once(served):
    client, calls = served
    calls.mark()
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, echo=True, logprobs=1)
    assert r.choices[0].logprobs.token_logprobs[0] is None  # the prompt's first token, scored with the rest
    assert calls.since() == {"resolve": 1, "expand": 0}


def test_responses_resolve_once(served):
    client, calls = served
    calls.mark()
    client.responses.create(model=MODEL, input="hi", max_output_tokens=8)
    assert calls.since() == {"resolve": 1, "expand": 0}


def test_an_image_is_expanded_once(served):
    """Its placeholder expanded once, at the edge; the parameters resolved once, for the expanded length."""
    client, calls = served
    calls.mark()
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": _image_url(1)}}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8, n=2)
    assert len(r.choices) == 2
    assert calls.since() == {"resolve": 1, "expand": 1}
