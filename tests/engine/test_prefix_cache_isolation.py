"""The prefix cache is no oracle across clients: by default a client finds
only its own cached prefixes (or those of the same cache_salt), so `cached_tokens` cannot confirm
another client's prompt; `--prefix-cache-scope global` shares them, as before. Two clients are two
source addresses on the loopback (127.0.0.1 and 127.0.0.2), against the real server."""

from __future__ import annotations

import httpx
from server_process import fixture_value, serve

KEY = "k"
SECRET = "the vault code is 4821 and the vault is under the old oak tree by the river"


def _cached(server, source: str, prompt: str, **extra) -> int:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as c:
        r = c.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "seed": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


server = serve(fixture_value("tiny"), "--served-model-name", "tiny", "--api-key", KEY, "--max-model-len", "256",
               "--block-size", "4", "--prefix-cache-scope", lambda request: request.param, params=["client", "global"])


def test_another_client_cannot_confirm_a_prompt_through_cached_tokens(server):
    assert _cached(server, "127.0.0.1", SECRET) == 0
    assert _cached(server, "127.0.0.1", SECRET) > 0  # the victim's own prefix is cached
    # Each guess from an address of its own: a client's own earlier guess is its own to reuse.
    guesses = {pin: _cached(server, source, SECRET.replace("4821", pin))
               for pin, source in (("4821", "127.0.0.2"), ("1234", "127.0.0.3"))}
    if server.param == "client":
        assert guesses == {"4821": 0, "1234": 0}
    else:  # shared on purpose: the right guess shows
        assert guesses["4821"] > guesses["1234"]


def test_a_shared_cache_salt_shares_across_clients_and_a_different_one_does_not(server):
    prompt = SECRET + " and the key is in the blue box"
    assert _cached(server, "127.0.0.1", prompt, cache_salt="team") == 0
    assert _cached(server, "127.0.0.2", prompt, cache_salt="team") > 0
    assert _cached(server, "127.0.0.2", prompt, cache_salt="other") == 0
