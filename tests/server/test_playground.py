"""The playground page at `/` in a real browser: Debian's headless Chromium driven by playwright,
against the real server on the bundled demo model, with an API key.

The server runs the demo at a warmer denoising temperature than its checkpoint's (--t-min 1.2
--t-max 2.4): at its own the demo is certain of "1 2 3" after one step, and there would be no
denoising to watch. A screenshot of the run is saved under test-artifacts/ (or
$BLOCKDIFF_TEST_ARTIFACTS); docs/quickstart.md shows it."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from PIL import Image
from server_process import serve

KEY = "playground-key"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("BLOCKDIFF_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
STEPS = 16  # the demo checkpoint's max_denoising_steps

# Installed before the page's own script: records every distinct state of the canvas grid and its
# step counter, as the DOM changes (the page renders each draft as it arrives).
RECORDER = """
window.__frames = [];
new MutationObserver(() => {
  const grid = document.getElementById("grid");
  const step = document.getElementById("step-count");
  if (!grid || !step) return;
  const cells = [...grid.children].map((c) => [c.textContent, c.dataset.state, c.dataset.entropy ?? null]);
  const frame = JSON.stringify({step: step.textContent, cells});
  if (window.__frames[window.__frames.length - 1] !== frame) window.__frames.push(frame);
}).observe(document, {subtree: true, childList: true, characterData: true, attributes: true});
"""


server = serve(None, "--api-key", KEY, "--t-min", "1.2", "--t-max", "2.4")


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium with an empty profile; each test opens its own pages (tabs), and so
    its own session storage."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium; .ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra: pip install -e '.[test]'")
    with tempfile.TemporaryDirectory() as profile, sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                                                       viewport={"width": 1100, "height": 720})
        yield context
        context.close()


class Watched:
    """A page with its console errors, uncaught exceptions and requests recorded."""

    def __init__(self, browser):
        self.page = browser.new_page()
        self.errors: list[str] = []
        self.requests = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("request", lambda r: self.requests.append(r))

    def frames(self) -> list[dict]:
        return [json.loads(f) for f in self.page.evaluate("window.__frames")]


def _expect():
    from playwright.sync_api import expect
    return expect


# ---- the page and the endpoints it reads, over plain HTTP ------------------------------------------
def test_page_and_files_are_served_without_the_key(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-api-key="required"' in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    # Everything the page loads is a path on this server.
    loaded = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert loaded and all(url.startswith("/static/") or url.startswith("data:") for url in loaded), loaded
    for url in loaded:
        if url.startswith("/static/"):
            assert httpx.get(server.url + url).status_code == 200, url
    # The exemption is exactly the page's files: anything else still needs the key.
    assert httpx.get(server.url + "/static/other.js").status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/static/other.js", headers=auth).status_code == 404


def test_models_card_carries_the_servers_sampling_defaults(server):
    [card] = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert card["canvas_length"] == 8
    d = card["sampling_defaults"]
    assert (d["t_min"], d["t_max"]) == (1.2, 2.4)  # the server's flags
    assert (d["max_denoising_steps"], d["entropy_bound"]) == (STEPS, 0.1)  # the checkpoint's generation_config.json
    assert d["max_tokens"] is None


def test_draft_events_carry_details_when_asked(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": "sort: 3 1 2"}], "stream": True, "stream_drafts": True, "seed": 0}
    for details in (True, False):
        drafts = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "draft_details": details},
                          headers=auth, timeout=60) as r:
            event = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: {") and event == "draft":
                    drafts.append(json.loads(line[6:])["choices"][0])
                    event = None
        assert drafts
        for d in drafts:
            if details:
                assert len(d["tokens"]) == len(d["entropy"]) == len(d["accepted"]) == len(d["token_ids"]) == 8
                assert "".join(t for t in d["tokens"] if not re.fullmatch(r"<\w+>", t)) == d["text"]
            else:
                assert d["tokens"] is None and d["entropy"] is None and d["accepted"] is None
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream_drafts": False, "draft_details": True},
                   headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "draft_details"


# ---- in the browser ----------------------------------------------------------------------------------
def test_autorun_shows_the_canvas_denoising_live(server, browser):
    w = Watched(browser)
    page = w.page
    page.add_init_script(RECORDER)
    page.goto(server.url + "/?prompt=sort:%203%201%202&autorun=1")
    expect = _expect()
    # The server has a key: the page asks for it before any call, then starts the chat.
    expect(page.locator("#key-form")).to_be_visible()
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    expect(page.locator("#finish")).to_contain_text("finish reason: stop", timeout=60_000)
    # The server panel, read from /metrics (vLLM's families added up over the engines) after the run.
    expect(page.locator("#stat-spc")).not_to_have_text("–", timeout=10_000)
    expect(page.locator("#stat-running")).to_have_text("0", timeout=10_000)

    expect(page.locator("#transcript li.user .content")).to_have_text("sort: 3 1 2")
    assert page.inner_text("#transcript li.assistant .content") == "1 2 3"
    frames = w.frames()
    final = frames[-1]
    states = [s for _, s, _ in final["cells"]]
    assert states[:6] == ["committed"] * 6 and "".join(t for t, _, _ in final["cells"][:6]) == "1␣2␣3<eos>"
    assert set(states[6:]) <= {"dropped"}
    drafts = [f for f in frames if f["cells"] and f["cells"][0][1] != "committed"]
    # At least two different canvas states before the final one, each cell in a state, shaded by its entropy.
    distinct = {json.dumps(f["cells"]) for f in drafts}
    assert len(distinct) >= 2, drafts
    seen = {s for f in drafts for _, s, _ in f["cells"]}
    assert "renoised" in seen and seen & {"accepted", "settled"}, seen
    assert all(e is not None for f in drafts for _, _, e in f["cells"])
    # The step counter advances, and the final count is the steps the server reports for the canvas.
    steps = [int(f["step"]) for f in drafts]
    assert steps == sorted(steps) and len(set(steps)) >= 2, steps
    finish = page.inner_text("#finish")
    reported = int(re.search(r"1 canvas, (\d+) steps", finish).group(1))
    assert int(final["step"]) == reported and reported > max(steps)
    assert page.inner_text("#step").startswith(f"canvas 1 (committed) · step {reported} / {STEPS}")
    # The text view says the same in words.
    page.click("#text-view summary")
    assert page.inner_text("#canvas-text").startswith(f"canvas 1, committed after {reported} steps: 6 tokens kept")

    # Replay the steps with the keyboard; the screenshot shows the step with the most kinds of cells.
    page.focus("#replay")
    page.keyboard.press("Home")
    best, best_kinds = 0, -1
    for i in range(int(page.get_attribute("#replay", "max")) + 1):
        kinds = len({s for s in page.locator("#grid .cell").evaluate_all("cells => cells.map(c => c.dataset.state)")})
        if kinds > best_kinds and "committed" not in page.inner_text("#step"):
            best, best_kinds = i, kinds
        page.keyboard.press("ArrowRight")
    page.keyboard.press("Home")
    for _ in range(best):
        page.keyboard.press("ArrowRight")
    assert re.match(r"canvas 1, step \d+ of 16: \d+ of 8 positions accepted", page.inner_text("#canvas-text"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "playground.png"
    page.screenshot(path=str(shot))
    # A palette of 256 colours keeps the text sharp at a third of the size (docs/quickstart.md shows it).
    Image.open(shot).convert("RGB").quantize(colors=256).save(shot, optimize=True)
    print(f"screenshot: {shot}")

    assert not w.errors, w.errors
    origin = urlsplit(server.url).netloc
    foreign = [r.url for r in w.requests if not r.url.startswith("data:") and urlsplit(r.url).netloc != origin]
    assert not foreign, foreign
    calls = [r for r in w.requests if urlsplit(r.url).path.startswith(("/v1/", "/metrics", "/detokenize"))]
    assert calls and all(r.headers.get("authorization") == f"Bearer {KEY}" for r in calls)
    page.close()


def test_the_key_is_asked_once_sent_with_every_call_and_refusals_explained(server, browser):
    expect = _expect()
    w = Watched(browser)
    page = w.page
    page.goto(server.url + "/")
    expect(page.locator("#key-form")).to_be_visible()
    assert not [r for r in w.requests if urlsplit(r.url).path.startswith(("/v1/", "/metrics"))]  # nothing asked yet

    # Without the key, a chat fails with a message that says so; the prompt is kept.
    page.fill("#prompt", "sort: 9 4 7")
    page.press("#prompt", "Enter")
    expect(page.locator("#alert")).to_contain_text("This server needs an API key, and none was sent (401")
    [call] = [r for r in w.requests if urlsplit(r.url).path == "/v1/chat/completions"]
    assert "authorization" not in call.headers
    expect(page.locator("#prompt")).to_have_value("sort: 9 4 7")

    # A wrong key is refused, with a message that says so.
    page.fill("#key-input", "not-the-key")
    page.press("#key-input", "Enter")
    expect(page.locator("#alert")).to_contain_text("The server refused this API key (401")
    expect(page.locator("#key-form")).to_be_visible()

    # The right one: the page connects, and the chat goes through.
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#model")).to_contain_text("model demo")
    page.press("#prompt", "Enter")
    expect(page.locator("#finish")).to_contain_text("finish reason: stop", timeout=60_000)
    assert page.inner_text("#transcript li.assistant:last-child .content") == "4 7 9"
    expect(page.locator("#alert")).to_be_empty()

    # The key is kept for the tab: a new page in it asks for nothing. The URL sets the prompt and a
    # sampler field; the others come from the server.
    page.goto(server.url + "/?prompt=reverse:%20diffusion&max_denoising_steps=32")
    expect(page.locator("#model")).to_contain_text("model demo")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#controls input[name=entropy_bound]")).to_have_value("0.1")
    expect(page.locator("#controls input[name=max_denoising_steps]")).to_have_value("32")
    expect(page.locator("#prompt")).to_have_value("reverse: diffusion")

    # Esc stops a turn in progress: the page drops it, and the server aborts the request.
    before = server.metrics().total("vllm:request_success_total", finished_reason="abort")
    page.press("#prompt", "Enter")
    expect(page.locator("#canvas-index")).to_have_text(re.compile(r"^canvas \d+$"), timeout=60_000)  # a draft
    page.keyboard.press("Escape")
    expect(page.locator("#finish")).to_have_text("stopped")
    expect(page.locator("#prompt")).to_have_value("reverse: diffusion")
    assert server.wait_idle().total("vllm:request_success_total", finished_reason="abort") == before + 1
    # A new tab is a new session, which asks again.
    other = browser.new_page()
    other.goto(server.url + "/")
    expect(other.locator("#key-form")).to_be_visible()
    other.close()
    page.close()
