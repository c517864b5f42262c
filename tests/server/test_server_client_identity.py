"""Who a client is (entrypoints/openai/clients.py): the address it connects from, or, from a proxy in
--forwarded-allow-ips only, the address its X-Forwarded-For names. Any local process connects from
127.0.0.1: the header must not make it another client, for the per-client limits or for the stored
responses. Linux answers on all of 127/8, so 127.0.0.2 is another host."""

from __future__ import annotations

from contextlib import contextmanager

import httpx
import pytest
from server_process import fixture_value, serve

ARGS = ("--max-model-len", "2048", "--max-client-concurrency", "1")
plain = serve(fixture_value("tiny"), *ARGS)
proxied = serve(fixture_value("tiny"), *ARGS, "--forwarded-allow-ips", "127.0.0.1")

LONG = {"prompt": "sort: 3 2 1", "max_tokens": 1500, "ignore_eos": True, "max_denoising_steps": 16,
        "stream": True}
SMALL = {"prompt": "sort: 2 1", "max_tokens": 4}


def call(server, method: str, path: str, source: str = "127.0.0.1", forwarded_for: str | None = None,
         **kw) -> httpx.Response:
    headers = {} if forwarded_for is None else {"X-Forwarded-For": forwarded_for}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as c:
        return c.request(method, server.url + path, headers=headers, **kw)


@contextmanager
def holding_the_only_slot(server, forwarded_for: str | None = None):
    """A long stream running for the client, whose one engine request it may have in progress."""
    headers = {} if forwarded_for is None else {"X-Forwarded-For": forwarded_for}
    with httpx.stream("POST", server.url + "/v1/completions", json=LONG, headers=headers, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a collected iterator would close the stream
        next(line for line in lines if line.startswith("data: "))
        yield


def stored_response(server, **source) -> str:
    r = call(server, "POST", "/v1/responses", json={"input": "upper: secret", "max_output_tokens": 4},
             **source)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_a_spoofed_forwarded_for_is_the_same_client(plain):
    with holding_the_only_slot(plain):
        for spoofed in ("10.0.0.1", "10.0.0.2", "127.0.0.2"):
            r = call(plain, "POST", "/v1/completions", json=SMALL, forwarded_for=spoofed)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests", r.text
        assert call(plain, "POST", "/v1/completions", json=SMALL, source="127.0.0.2").status_code == 200


def test_a_spoofed_forwarded_for_reads_no_other_clients_response(plain):
    victims = stored_response(plain, source="127.0.0.2")
    for method in ("GET", "DELETE"):
        r = call(plain, method, f"/v1/responses/{victims}", forwarded_for="127.0.0.2")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    # The header is ignored, not held against its sender: the response is the peer's.
    own = stored_response(plain, forwarded_for="10.0.0.1")
    assert call(plain, "GET", f"/v1/responses/{own}").status_code == 200
    assert call(plain, "GET", f"/v1/responses/{victims}", source="127.0.0.2").status_code == 200


def test_a_trusted_proxys_forwarded_for_names_the_client(proxied):
    with holding_the_only_slot(proxied, forwarded_for="10.0.0.1"):
        r = call(proxied, "POST", "/v1/completions", json=SMALL, forwarded_for="10.0.0.1")
        assert r.status_code == 429, r.text
        assert call(proxied, "POST", "/v1/completions", json=SMALL, forwarded_for="10.0.0.2").status_code == 200
        # A proxy appends the address it saw: the client is the last one no trusted proxy added.
        r = call(proxied, "POST", "/v1/completions", json=SMALL, forwarded_for="10.0.0.2, 10.0.0.1")
        assert r.status_code == 429, r.text
        # 127.0.0.2 is no trusted proxy: its header is ignored, and it is a client of its own.
        assert call(proxied, "POST", "/v1/completions", json=SMALL, source="127.0.0.2",
                    forwarded_for="10.0.0.1").status_code == 200


@pytest.mark.parametrize("other", [{"forwarded_for": "10.0.0.2"}, {}, {"source": "127.0.0.2", "forwarded_for": "10.0.0.1"}],
                         ids=["another-forwarded-for", "the-proxy-itself", "an-untrusted-peer-naming-the-owner"])
def test_a_response_stored_behind_a_trusted_proxy_is_its_clients(proxied, other):
    made = stored_response(proxied, forwarded_for="10.0.0.1")
    r = call(proxied, "GET", f"/v1/responses/{made}", **other)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    assert call(proxied, "GET", f"/v1/responses/{made}", forwarded_for="10.0.0.1").status_code == 200
