"""vLLM-compatible KV cache events: subscribed to with pyzmq and decoded with msgpack in
the field layout of vLLM's EventBatch (vllm/distributed/kv_events.py), as llm-d, Dynamo or SGLang's
router would. The block hashes are computed here from the documented scheme (engine/kv_events.py:
the low 64 bits of blockdiff's SHA-256 block key), independently of the engine."""

from __future__ import annotations

import hashlib
import json
import time
from array import array

import httpx
import msgpack
import pytest
import zmq
import zmq.auth

from blockdiff import LLM, SamplingParams
from blockdiff.entrypoints.cli import main
from server_process import ServerProcess, free_port

BS = 16
PROMPT = [(11 * i) % 280 + 10 for i in range(40)]  # two full blocks and a tail


def _hashes(tokens: list[int]) -> list[int]:
    """The published hash of each full block of `tokens`: SHA-256 over the parent's key and the
    tokens as 8-byte ids after a b"t", chained; its last 8 bytes read big-endian."""
    out, parent = [], b""
    for i in range(0, len(tokens) - BS + 1, BS):
        parent = hashlib.sha256(parent + b"t" + array("q", tokens[i:i + BS]).tobytes()).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def _ports() -> tuple[int, int]:
    a = free_port()
    while (b := free_port()) == a:
        pass
    return a, b


def _curve(sock: zmq.Socket, curve: tuple[tuple[bytes, bytes], bytes] | None) -> zmq.Socket:
    """`sock` as a CURVE client with `curve`, ((its public key, its secret key), the server's public
    key), as a router configures its sockets; None: in clear."""
    if curve is not None:
        (sock.curve_publickey, sock.curve_secretkey), sock.curve_serverkey = curve
    return sock


def _replay(port: int, start: int = 0, curve=None, timeout_ms: int = 5000) -> list[tuple[int, list]]:
    """Every buffered batch from sequence `start` on, through the replay (ROUTER) socket as vLLM's
    subscriber asks for it: -> [(sequence, decoded EventBatch)]; zmq.Again if no answer comes."""
    sock = _curve(zmq.Context.instance().socket(zmq.DEALER), curve)  # one request, many replies
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        while True:
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                return batches
            batches.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    finally:
        sock.close(linger=0)


def _events(batches) -> list[dict]:
    return [e for _, (ts, events, rank) in batches for e in events]


@pytest.fixture
def published(tiny):
    """An engine publishing on a PUB socket and a replay socket, with a subscriber connected."""
    pub, replay = _ports()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@tiny"}
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    with LLM(tiny, block_size=BS, max_model_len=128, kv_events_config=config) as llm:
        time.sleep(0.3)  # a SUB socket gets only what is published after it connected
        yield llm, sub, replay
    sub.close(linger=0)


def test_events_decode_in_vllms_layout_and_their_hashes_are_what_a_repeat_hits(published):
    llm, sub, replay = published
    params = SamplingParams(max_tokens=16, max_denoising_steps=4, seed=1)
    [first] = llm.generate([PROMPT], params, use_tqdm=False)
    [again] = llm.generate([PROMPT], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32

    live = []
    while sub.poll(500):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@tiny"
        live.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    assert [seq for seq, _ in live] == list(range(len(live)))  # numbered from 0, one per step with events
    for _, batch in live:
        ts, events, rank = batch  # EventBatch(ts, events, data_parallel_rank): an array
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
        assert events and all(isinstance(e, dict) for e in events)  # each event a map tagged by "type"
    assert _replay(replay) == live  # the replay socket resends the same batches

    stored = [e for e in _events(live) if e["type"] == "BlockStored"]
    prompt_blocks = stored[0]
    assert prompt_blocks == {
        "type": "BlockStored", "block_hashes": _hashes(PROMPT), "parent_block_hash": None, "token_ids": PROMPT[:32],
        "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
        "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    # The repeat hit exactly the blocks the first request stored of its prompt.
    assert again.num_cached_tokens == BS * len(prompt_blocks["block_hashes"])
    # The committed canvases' blocks continue the chain: the first output block hangs off the prompt's.
    output = PROMPT + first.token_ids
    assert stored[1]["parent_block_hash"] == _hashes(PROMPT)[-1]
    assert stored[1]["block_hashes"] == _hashes(output)[2:2 + len(stored[1]["block_hashes"])]
    assert stored[1]["token_ids"] == output[32:32 + BS * len(stored[1]["block_hashes"])]
    # A block already cached is not stored twice: the repeat's prompt blocks were hits.
    assert [h for e in stored for h in e["block_hashes"]].count(_hashes(PROMPT)[0]) == 1
    assert _replay(replay, start=len(live) - 1) == live[-1:]


def test_evicted_blocks_are_removed_and_a_reset_clears_all(published):
    """A cache of few blocks evicts what earlier requests left cached; new workers forget it all."""
    llm, sub, replay = published
    params = SamplingParams(max_tokens=8, max_denoising_steps=2, seed=1)
    blocks = llm.engine.kv.full.num_blocks
    prompts = [[(7 * i + 13 * k) % 280 + 10 for i in range(48)] for k in range(blocks // 3 + 2)]
    llm.generate(prompts, params, use_tqdm=False)
    llm.engine.reset_after_worker_loss()
    deadline = time.monotonic() + 5
    while (events := _events(_replay(replay)))[-1] != {"type": "AllBlocksCleared"} and time.monotonic() < deadline:
        time.sleep(0.3)  # the publisher's thread sends what was queued (and a peer gets 4 replays a second)
    stored = {h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and set(removed) <= stored
    assert all(e == {"type": "BlockRemoved", "block_hashes": e["block_hashes"], "medium": "GPU", "group_idx": 0}
               for e in events if e["type"] == "BlockRemoved")
    assert events[-1] == {"type": "AllBlocksCleared"}


def test_the_array_encoding_of_vllm_0_11_to_0_23_and_the_rank_offset(tiny):
    """`"encoding": "array"`: each event a positional array, tag first, vLLM's field order; a
    replica of data_parallel_rank 1 publishes on the endpoint's port + 1 with rank 1 in its batches."""
    pub, replay = _ports()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub - 1}",
              "replay_endpoint": f"tcp://*:{replay - 1}", "encoding": "array"}
    with LLM(tiny, block_size=BS, max_model_len=128, kv_events_config=config, data_parallel_size=2,
             data_parallel_rank=1) as llm:
        llm.generate([PROMPT], SamplingParams(max_tokens=8, max_denoising_steps=2, seed=1), use_tqdm=False)
        batches = _replay(replay)
    assert {rank for _, (ts, events, rank) in batches} == {1}
    first = _events(batches)[0]
    assert first == ["BlockStored", _hashes(PROMPT), None, PROMPT[:32], BS, None, "GPU", None]


def test_bad_configs_are_one_line_errors(capsys, tiny):
    for config, message in [('{"enable_kv_cache_events": true, "bogus": 1}', "kv_events_config: unknown key 'bogus'"),
                            ("{not json", "kv_events_config must be a JSON object"),
                            ('{"publisher": "kafka"}', "publisher must be 'zmq' or 'null', got 'kafka'")]:
        with pytest.raises(SystemExit) as exit:
            main(["serve", "--kv-events-config", config])
        assert exit.value.code == 2
        assert capsys.readouterr().err.startswith(f"error: argument --kv-events-config: {message}")
    # --api-key covers the events: they are not published unauthenticated.
    assert main(["serve", "--api-key", "k", "--kv-events-config", '{"enable_kv_cache_events": true}']) == 2
    assert capsys.readouterr().err.startswith("error: kv_events_config: with --api-key, KV events (every client's "
                                              "prompt tokens) are published only to routers that authenticate")
    with pytest.raises(ValueError, match="curve_clients_dir '/nonexistent' is not a directory of public keys"):
        LLM(tiny, kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}",
                                    "curve_clients_dir": "/nonexistent"})
    port = free_port()
    with LLM(tiny, kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}):
        with pytest.raises(ValueError, match="cannot open the endpoint"):
            LLM(tiny, kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})


def _addresses() -> list[str]:
    """This machine's IPv4 addresses other than the loopback's."""
    import socket

    import psutil

    return sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127.")})


def test_events_are_private_to_the_hosts_address_by_default(tiny):
    """Without an endpoint the publisher binds the server's address (the loopback here): a subscriber
    on another address of the machine gets nothing, one on the loopback gets the events."""
    if not _addresses():
        pytest.skip("this machine has no address but the loopback's to subscribe from")
    config = {"enable_kv_cache_events": True}
    outside = [zmq.Context.instance().socket(zmq.SUB) for _ in _addresses()]
    for sock, address in zip(outside, _addresses()):
        sock.connect(f"tcp://{address}:5557")
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    inside = zmq.Context.instance().socket(zmq.SUB)
    inside.connect("tcp://127.0.0.1:5557")
    inside.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with LLM(tiny, block_size=BS, max_model_len=128, kv_events_config=config) as llm:
            assert llm.engine.kv_publisher.endpoint == "tcp://127.0.0.1:5557"
            time.sleep(0.3)
            llm.generate([PROMPT], SamplingParams(max_tokens=16, max_denoising_steps=2, seed=1), use_tqdm=False)
            assert inside.poll(3000)
            assert not any(sock.poll(500) for sock in outside)
    finally:
        for sock in [inside, *outside]:
            sock.close(linger=0)


def test_replay_requests_are_bounded_in_size_and_rate_and_live_events_go_on(published):
    llm, sub, replay = published
    params = SamplingParams(max_tokens=16, max_denoising_steps=2, seed=1)
    llm.generate([PROMPT], params, use_tqdm=False)
    time.sleep(1.1)  # the fixture's own replay budget is fresh
    big = zmq.Context.instance().socket(zmq.DEALER)
    big.connect(f"tcp://127.0.0.1:{replay}")
    big.send_multipart([b"", b"x" * (1 << 20)])  # over the size bound: its peer is dropped unread
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.connect(f"tcp://127.0.0.1:{replay}")
    flood.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        started = time.monotonic()
        for _ in range(40):
            flood.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = []  # the batches of each answer: every request is answered, only 4 a second with batches
        for _ in range(40):
            batches = 0
            while int.from_bytes(flood.recv_multipart()[1], "big", signed=True) != -1:
                batches += 1
            answers.append(batches)
        seconds = time.monotonic() - started
        assert answers[0] > 0 and sum(1 for b in answers if b) <= 4 * (seconds + 1), (answers, seconds)
        assert sum(1 for b in answers if not b) >= 40 - 4 * (seconds + 1) > 0
        while sub.poll(100):
            sub.recv_multipart()
        llm.generate([[t + 1 for t in PROMPT]], params, use_tqdm=False)
        assert sub.poll(3000)  # live events still flow
        assert big.poll(200) == 0
    finally:
        big.close(linger=0)
        flood.close(linger=0)


# ---- who can read them ----------------------------------------------------------------------------
def _subscriber(port: int, curve=None) -> zmq.Socket:
    sock = _curve(zmq.Context.instance().socket(zmq.SUB), curve)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


@pytest.fixture
def keys(tmp_path) -> dict:
    """Key pairs made as the docs say, with zmq.auth: a router's, whose public key is in the directory
    the server is given, and the server's. -> the config's keys, and each peer's `_curve` argument."""
    (tmp_path / "routers").mkdir()
    (tmp_path / "server").mkdir()
    _, router_secret = zmq.auth.create_certificates(tmp_path / "routers", "router")
    server_public, server_secret = zmq.auth.create_certificates(tmp_path / "server", "server")
    server_key = zmq.auth.load_certificate(server_public)[0]
    return {"config": {"curve_clients_dir": str(tmp_path / "routers"), "curve_server_secret_key_file": str(server_secret)},
            "router": (zmq.auth.load_certificate(router_secret), server_key),
            "stranger": (zmq.curve_keypair(), server_key)}


def test_under_curve_only_a_router_with_a_key_gets_events_or_replays(tiny, keys):
    """With curve_clients_dir (which `serve --api-key` requires) the router holding a listed key reads
    vLLM's events, live and replayed; a peer in clear, or with a key of its own, gets nothing from
    either socket."""
    pub, replay = _ports()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
              "require_curve": True, **keys["config"]}
    subs = {name: _subscriber(pub, curve) for name, curve in (("router", keys["router"]), ("clear", None),
                                                              ("stranger", keys["stranger"]))}
    try:
        with LLM(tiny, block_size=BS, max_model_len=128, kv_events_config=config) as llm:
            time.sleep(0.3)  # a SUB socket gets only what is published after it connected
            llm.generate([PROMPT], SamplingParams(max_tokens=8, max_denoising_steps=2, seed=1), use_tqdm=False)
            assert subs["router"].poll(5000)
            _, seq, payload = subs["router"].recv_multipart()
            ts, events, rank = msgpack.unpackb(payload)
            assert int.from_bytes(seq, "big") == 0 and rank == 0
            assert events[0] == {
                "type": "BlockStored", "block_hashes": _hashes(PROMPT), "parent_block_hash": None,
                "token_ids": PROMPT[:32], "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": [None, None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
            assert _replay(replay, curve=keys["router"])[0] == (0, [ts, events, rank])
            assert not subs["clear"].poll(500) and not subs["stranger"].poll(0)
            for curve in (None, keys["stranger"]):
                with pytest.raises(zmq.Again):
                    _replay(replay, curve=curve, timeout_ms=1000)
    finally:
        for sock in subs.values():
            sock.close(linger=0)


@pytest.mark.slow  # a server of its own
def test_serve_with_an_api_key_publishes_to_the_routers_keys_only(tiny, keys, tmp_path):
    pub, replay = _ports()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", **keys["config"]}
    subs = [_subscriber(pub, keys["router"]), _subscriber(pub)]
    server = ServerProcess(tiny, "--api-key", "k", "--max-model-len", "128", "--kv-events-config", json.dumps(config),
                           log_path=str(tmp_path / "server.log"))
    try:
        time.sleep(0.3)
        r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                       json={"prompt": PROMPT, "max_tokens": 8, "max_denoising_steps": 2})
        assert r.status_code == 200, r.text
        assert subs[0].poll(5000)
        assert msgpack.unpackb(subs[0].recv_multipart()[2])[1][0]["token_ids"][:16] == PROMPT[:16]
        assert not subs[1].poll(500)
        assert "CURVE only" in server.log() and "in clear" not in server.log()
    finally:
        server.close()
        for sock in subs:
            sock.close(linger=0)


def test_events_beyond_the_loopback_in_clear_are_warned_about(tiny, caplog):
    """Without CURVE (and so without --api-key) a socket beyond the loopback is named at start with
    what it carries; one on the loopback is not. Nothing here connects from another address."""
    pub, replay = _ports()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    with caplog.at_level("WARNING", logger="blockdiff.engine.kv_events"), LLM(tiny, kv_events_config=config):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.name == "blockdiff.engine.kv_events"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"KV events on tcp://0.0.0.0:{pub} reach beyond this machine in clear")
    assert "every client's prompt and output token ids" in warnings[0]
