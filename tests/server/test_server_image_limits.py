"""Image input within bounds, against a real server of a tiny vision checkpoint with the default
image limits: decompression bombs are refused from their header,
large images are decoded in a bounded pool without keeping their memory, URL fetches have a total
deadline and a pool of their own, broken images are 400s, and errors name no server path."""

from __future__ import annotations

import http.server
import io
import struct
import threading
import time
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image
from server_process import HealthProbe, fixture_value, rss_mib, serve
from test_server_images import VISION_SPEC, _data_url, _messages, _png

FETCH_TIMEOUT = 2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


server = serve(fixture_value("checkpoints", lambda checkpoints: checkpoints("vision", **VISION_SPEC)),
               "--max-model-len", "512", "--max-denoising-steps", "4",
               "--media-fetch-timeout", str(FETCH_TIMEOUT), "--image-fetch-threads", "2",
               "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", fixture_value("files"))


def _chat(server, messages, timeout=300) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4}, timeout=timeout)


def _concurrently(server, messages, requests: int) -> list[httpx.Response]:
    out: list = [None] * requests
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _chat(server, messages))) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _served_after(server) -> None:
    r = _chat(server, _messages(_data_url(_png(Image.new("RGB", (32, 32), (200, 10, 10))))))
    assert r.status_code == 200, r.text


def test_decompression_bombs_are_refused_from_their_header(server):
    """A 6300 x 6300 RGBA PNG of zeros: 154 kB sent, under the 40 M-pixel limit, 159 MB decoded.
    Six requests of four each: before, 46 s, RSS from 934 MB to a 4.1 GB peak with 3.3 GB kept,
    /health 3.9 s. Now each is a 400 before anything is decoded."""
    bomb = _png(Image.new("RGBA", (6300, 6300)))
    assert len(bomb) < 200_000
    rss = rss_mib(server.proc.pid)
    with HealthProbe(server) as probe:
        responses = _concurrently(server, _messages(*[_data_url(bomb)] * 4), 6)
    grown = rss_mib(server.proc.pid) - rss
    print(f"bombs: {[r.status_code for r in responses]}, {probe}, RSS +{grown:.0f} MiB")
    for r in responses:
        assert r.status_code == 400, r.text
        assert "decodes to 158760000 bytes, above the limit of 67108864" in r.json()["error"]["message"]
    probe.check()
    assert grown < 200
    _served_after(server)


def test_large_images_are_decoded_in_a_bounded_pool_and_their_memory_given_back(server):
    """Images just under the decoded-size limit (4000 x 4000 RGB), four at once: decoded one at a time,
    and the heap is trimmed after each request's, so RSS does not keep their peak."""
    big = _png(Image.fromarray(np.tile(np.arange(4000, dtype=np.uint8)[:, None, None], (1, 4000, 3))))
    rss = rss_mib(server.proc.pid)
    with HealthProbe(server) as probe:
        responses = _concurrently(server, _messages(_data_url(big), _data_url(big)), 2)
    grown = rss_mib(server.proc.pid) - rss
    print(f"large images: {[r.status_code for r in responses]}, {probe}, RSS +{grown:.0f} MiB")
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    probe.check()
    assert grown < 200


def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def _bmp_header(width: int, height: int) -> bytes:
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(info) + 64, 0, 0, 14 + len(info)) + info + b"\x00" * 64


def _jpeg(size: int = 256) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("name, url, says", [
    # Pillow's DecompressionBombError at open, and a truncated JPEG's OSError, were once 500s.
    ("png-header-100000x100000", _data_url(_png_header(100_000, 100_000)), "above the limit of 40000000 pixels"),
    ("bmp-header-100000x100000", _data_url(_bmp_header(100_000, 100_000), "image/bmp"), "above the limit of 40000000 pixels"),
    ("jpeg-cut-to-a-third", _data_url(_jpeg()[: len(_jpeg()) // 3], "image/jpeg"), "is corrupt"),
])
def test_broken_images_are_400s(server, name, url, says):
    r = _chat(server, _messages(url))
    assert r.status_code == 400, (name, r.text)
    error = r.json()["error"]
    assert error["code"] == "invalid_image" and says in error["message"], (name, error)
    _served_after(server)


def test_local_file_errors_name_no_path(server, files):
    for url in ("file:///etc/passwd", f"file://{files}/missing.png", f"file://{files}/../../etc/passwd"):
        r = _chat(server, _messages(url))
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "/etc" not in message and str(files) not in message, message


@pytest.fixture
def trickle():
    """An HTTP server sending its 1,000-byte images one byte every half second."""
    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:  # the fetch gave up
                pass

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_url_fetches_have_a_total_deadline_and_a_pool_of_their_own(server, trickle):
    """The 10 s timeout was once per read, so a trickle held a fetch for as long as it lasted
    (40 s seen), and eight filled the pool that a data: image then waited 38 s behind. Now four
    fetches, for two fetch threads, each end with a 400 at --media-fetch-timeout, and a data: image
    sent meanwhile is served without waiting for them."""
    fetched: dict[int, tuple[httpx.Response, float]] = {}

    def fetch(i: int) -> None:
        r = _chat(server, _messages(f"{trickle}/slow{i}.png"))
        fetched[i] = (r, time.monotonic())

    t0 = time.monotonic()
    threads = [threading.Thread(target=fetch, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    data = _chat(server, _messages(_data_url(_png(Image.new("RGB", (32, 32), (0, 90, 0))))))
    data_done = time.monotonic()
    for t in threads:
        t.join()
    assert data.status_code == 200, data.text
    assert data_done < min(end for _, end in fetched.values())
    for r, end in fetched.values():
        assert r.status_code == 400, r.text
        assert f"did not arrive within {FETCH_TIMEOUT} s" in r.json()["error"]["message"], r.text
        # Two rounds of two fetches, each given up within its timeout and one read more.
        assert end - t0 < 2 * 2 * FETCH_TIMEOUT + 5
