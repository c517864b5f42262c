"""`blockdiff serve --data-parallel-size 2` on the demo model: two engine-core processes
behind one front end, served to the official openai client. Which replica served a request is read
from /metrics, where vLLM's families are labelled by `engine`. One server is shared by the module;
the test that kills a replica runs last."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import msgpack
import openai
import pytest
import zmq

from blockdiff import LLM, SamplingParams
from server_process import ServerProcess, fixture_value, free_port, serve

SUCCESS = 'vllm:request_success_total{{engine="{}",finished_reason="{}",model_name="demo"}}'
RUNNING = 'vllm:num_requests_running{{engine="{}",model_name="demo"}}'


@pytest.fixture(scope="module")
def events_port():
    while True:  # the replicas publish on port + rank
        port = free_port()
        if port < 65535:
            return port


server = serve(None, "--data-parallel-size", "2", "--kv-events-config", fixture_value(
    "events_port", lambda port: '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", "topic": "kv"}'
    % port))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _served(server: ServerProcess) -> dict[str, float]:
    """Requests each replica has finished so far."""
    m = server.metrics()
    return {e: sum(m.get(SUCCESS.format(e, r), 0) for r in ("stop", "length", "abort", "error")) for e in "01"}


def _which(server: ServerProcess, before: dict[str, float]) -> list[str]:
    """The replicas whose finished count grew since `before` (once per request)."""
    deadline = time.monotonic() + 10
    while True:  # a replica reports its finished requests right after their last output
        after = _served(server)
        grew = [e for e in "01" for _ in range(int(after[e] - before[e]))]
        if grew or time.monotonic() > deadline:
            return grew
        time.sleep(0.05)


def _replica_pids(server: ServerProcess) -> list[int]:
    """The server's engine-core processes now, by rank: the front end logs their pids at start and
    at each restart."""
    pids = {}
    for line in server.log().splitlines():
        if m := re.search(r"data parallel: \d+ replicas \(pids ([\d, ]+)\)", line):
            pids = dict(enumerate(int(p) for p in m.group(1).split(", ")))
        elif m := re.search(r"replica (\d+) restarted \(try \d+, pid (\d+)\)", line):
            pids[int(m.group(1))] = int(m.group(2))
    for rank, pid in pids.items():  # the process is the server's child
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == server.proc.pid, (rank, pid)
    return [pids[r] for r in sorted(pids)]


def test_both_replicas_take_requests_from_the_openai_client(server, client):
    before = _served(server)
    prompts = ["reverse: stone", "upper: river", "sort: 3 1 2", "reverse: cloud"]
    replies = [None] * len(prompts)

    def ask(i: int) -> None:
        replies[i] = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompts[i]}],
                                                    max_tokens=32, seed=i)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.choices[0].message.content for r in replies[:3]] == ["enots", "RIVER", "1 2 3"]
    served = _which(server, before)
    assert len(served) == 4 and set(served) == {"0", "1"}, served  # by load, and idle replicas take turns
    m = server.metrics()
    blocks = [m[f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="{e}",'
                f'model_name="demo",num_gpu_blocks="1024",prefix_caching_hash_algo="sha256"}}'] for e in "01"]
    assert blocks == [1, 1]
    assert m.total("vllm:request_success_total", finished_reason="stop") >= 4


def test_a_repeated_long_prefix_goes_to_the_replica_that_cached_it(server, client):
    """Idle replicas that tie on load take turns, so without affinity the repeats would alternate."""
    document = "copy: " + "the quick brown fox jumps over the lazy dog. " * 4
    before = _served(server)
    first = client.completions.create(model="demo", prompt=document, max_tokens=8, seed=5)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    [home] = _which(server, before)
    for i in range(3):
        before = _served(server)
        again = client.completions.create(model="demo", prompt=document + f" ({i})", max_tokens=8, seed=5)
        assert _which(server, before) == [home]
        assert again.usage.prompt_tokens_details.cached_tokens >= len(document) // 16 * 16 - 16


def test_seeded_outputs_are_equal_across_replicas(server, client):
    """A prompt shorter than a block has no prefix to follow: the idle replicas take it in turns."""
    served, texts = [], []
    for _ in range(2):
        before = _served(server)
        out = client.completions.create(model="demo", prompt="upper: seed", max_tokens=24, seed=123,
                                        extra_body={"ignore_eos": True, "t_min": 0.9, "t_max": 1.3})
        [replica] = _which(server, before)
        served.append(replica)
        texts.append(out.choices[0].text)
    assert sorted(served) == ["0", "1"]
    assert texts[0] == texts[1] and len(texts[0]) >= 16


def test_structured_outputs_on_either_replica(server, client):
    """The replica that takes a request builds its automaton; what it cannot build comes back as a
    400 naming the field, and the server stays up."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    served = []
    for seed in range(2):  # a prompt shorter than a block: the idle replicas take it in turns
        before = _served(server)
        out = client.completions.create(model="demo", prompt="json:", max_tokens=48, seed=seed,
                                        extra_body={"structured_outputs": {"json": schema}})
        served += _which(server, before)
        reply = json.loads(out.choices[0].text)
        assert set(reply) == {"n", "ok"} and isinstance(reply["n"], int) and isinstance(reply["ok"], bool), reply
    assert sorted(served) == ["0", "1"]
    bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "maximum": 3}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       response_format=bad)
    assert e.value.body["param"] == "response_format" and "'maximum' is not supported" in e.value.body["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_each_replica_publishes_its_kv_events_on_its_own_port(server, client, events_port):
    """vLLM's layout: port + rank per replica, and the rank in every EventBatch."""
    ctx = zmq.Context.instance()
    subs = []
    for rank in range(2):
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{events_port + rank}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        subs.append(sub)
    time.sleep(0.5)  # a SUB socket receives only what is published after it connected
    try:
        prompt = "copy: " + "".join(chr(97 + (i * 7) % 26) for i in range(64))
        before = _served(server)
        client.completions.create(model="demo", prompt=prompt, max_tokens=8, seed=1)
        [rank] = _which(server, before)
        stored = {0: [], 1: []}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not stored[int(rank)]:
            for r, sub in enumerate(subs):
                while sub.poll(50):
                    topic, seq, payload = sub.recv_multipart()
                    ts, events, dp_rank = msgpack.unpackb(payload)
                    assert (topic, dp_rank) == (b"kv", r)
                    stored[r] += [e for e in events if e["type"] == "BlockStored"]
        assert stored[int(rank)], stored
        assert not stored[1 - int(rank)]  # the other replica stored nothing of it
        tokens = [t for e in stored[int(rank)] for t in e["token_ids"]]
        ids = httpx.post(server.url + "/tokenize", json={"model": "demo", "prompt": prompt}).json()["tokens"]
        assert tokens[:len(ids) // 16 * 16] == ids[:len(ids) // 16 * 16]
    finally:
        for sub in subs:
            sub.close(linger=0)


@pytest.mark.slow  # two replica processes of their own: ~20 s on a busy 2-core machine
def test_llm_with_two_replicas_generates_what_one_engine_does(tiny):
    prompts = [[5, 6, 7, 8], [9, 10, 11] * 7, [12] * 3]
    params = SamplingParams(max_tokens=16, seed=7)
    with LLM(tiny, max_model_len=64) as one:
        expected = [o.token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny, max_model_len=64, data_parallel_size=2) as two:
        assert two.engine is None
        assert [o.token_ids for o in two.generate(prompts, params, use_tqdm=False)] == expected
        assert [t for o in two.stream(prompts[0], params) for t in o.token_ids] == expected[0]  # nothing cached: under a block
        # Without a seed, the two replicas (one request each: they tie on load) draw different ones.
        a, b = two.generate([prompts[0]] * 2, SamplingParams(max_tokens=16), use_tqdm=False)
        assert a.token_ids != b.token_ids


@pytest.mark.slow  # a replica restarted: ~11 s on 2 cores
def test_killing_a_replica_fails_only_its_requests(server, client):
    """Two long streams, one on each replica; SIGKILL one replica: its stream ends with a 503 error
    event, the other finishes, the server keeps serving, and the replica comes back."""
    pids = _replica_pids(server)
    assert len(pids) == 2, pids
    results: dict[int, tuple] = {}
    body = {"model": "demo", "prompt": "upper: long", "max_tokens": 600, "stream": True, "seed": 9, "ignore_eos": True,
            "stream_options": {"include_usage": True}}

    def stream(i: int) -> None:
        tokens, error = None, None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = httpx.Response(200, content=line[6:]).json()
                    if "error" in event:
                        error = event["error"]
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
        results[i] = (tokens, error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while True:  # both running, one on each replica
        m = server.metrics()
        if m.get(RUNNING.format(0)) == 1 and m.get(RUNNING.format(1)) == 1:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while RUNNING.format(0) in server.metrics():  # noticed when its socket closes: at once
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The other replica serves meanwhile.
    assert httpx.get(server.url + "/health").status_code == 200
    before = _served(server)
    out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "reverse: alive"}],
                                         max_tokens=16, seed=1)
    assert out.choices[0].message.content == "evila"
    assert _which(server, before) == ["1"]
    for t in threads:
        t.join(120)
    errors = sorted((results[i][1] or {}).get("code", "none") for i in range(2))
    assert errors == ["engine_unavailable", "none"], results
    assert sorted(tokens for tokens, error in results.values() if error is None) == [600]
    # Replica 0 is started again, and takes requests again.
    deadline = time.monotonic() + 120
    while RUNNING.format(0) not in server.metrics():
        assert time.monotonic() < deadline, "replica 0 did not come back"
        time.sleep(0.2)
    new = _replica_pids(server)
    assert len(new) == 2 and pids[0] not in new and pids[1] in new
    before = _served(server)
    threads = [threading.Thread(target=lambda: client.completions.create(model="demo", prompt="upper: back",
                                                                        max_tokens=32, seed=2)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(_which(server, before)) == ["0", "1"]
    assert "replica 0 was lost" in server.log() and "replica 0 restarted" in server.log()


def test_affinity_yields_to_load():
    """The policy alone: the longest match wins among replicas within `imbalance` of the least
    loaded; past it, the least loaded; ties in load take turns."""
    from blockdiff.engine.prefix_router import Candidate, PrefixIndex, PrefixRouter

    cached = PrefixIndex()
    cached.stored_blocks([b"a", b"b", b"c"])
    partial = PrefixIndex()
    partial.stored_blocks([b"a"])
    router = PrefixRouter(imbalance=2)
    keys = [b"a", b"b", b"x"]
    pick = lambda *cands: router.choose(list(cands), keys)  # noqa: E731
    assert pick(Candidate("hit", 2, 10, cached), Candidate("idle", 0, 10, partial))[0].name == "hit"
    assert pick(Candidate("hit", 3, 10, cached), Candidate("idle", 0, 10, partial))[0].name == "idle"
    chosen, matched = router.choose([Candidate("hit", 3, 10, cached), Candidate("part", 1, 10, partial),
                                     Candidate("idle", 0, 10, None)], keys)
    assert (chosen.name, matched) == ("part", 1)
    cached.expect([b"x"])  # a request routed there will store it
    assert cached.match(keys) == 3
    cached.done([b"x"])
    cached.removed_blocks([b"b"])
    assert cached.match(keys) == 1
    turns = [router.choose([Candidate("p", 0, 5), Candidate("q", 0, 5)], ())[0].name for _ in range(4)]
    assert turns in (["p", "q", "p", "q"], ["q", "p", "q", "p"])
    assert router.choose([Candidate("p", 0, 5), Candidate("q", 0, 9)], ())[0].name == "q"  # more free blocks
