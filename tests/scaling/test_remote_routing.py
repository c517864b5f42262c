"""The routing of a remote engine client's replicas (engine/prefix_router.py's ReplicaRouting), run
once for each transport: the engine's KV events reach it as the data-parallel front end gets them
from a replica's process (core_process's ("kv", events)), and as Ray Serve's router reads them off a
replica's ZMQ sockets (engine/ray_transport.py, its replica and its ranking, run here without Ray)."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import threading
import time

import pytest

from blockdiff import LLM, SamplingParams
from blockdiff.config import EngineConfig
from blockdiff.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch, hashed
from blockdiff.engine.prefix_router import ReplicaRouting, prompt_block_keys
from blockdiff.engine.ray_transport import AffinityRanking, ReplicaServer

BS = 16
PROMPT = [(11 * i) % 280 + 10 for i in range(40)]  # two full blocks and a tail
TRANSPORTS = ["processes", "ray"]


class ProcessRouting:
    """The routing as dp_client.DPClient runs it: events as a replica's process sends them."""

    def __init__(self, replica: ReplicaServer, seen: list):
        stats = replica.engine.stats()
        self.routing, self.seen = ReplicaRouting(imbalance=2), seen
        self.block_size, self.scope = stats.block_size, stats.prefix_cache_scope

    def choose(self, loads: dict[str, int], request) -> str:
        self.routing.events("home", hashed(self.seen))
        self.seen.clear()
        keys = prompt_block_keys(request, self.block_size, self.scope)
        return self.routing.choose([(name, load, 10) for name, load in loads.items()], keys)

    def forget(self, name: str) -> None:
        self.routing.forget(name)


class RayRouting:
    """The routing as Ray Serve's PrefixAffinityRouter runs it: the replica's routing stats name its
    KV event sockets, which the ranking follows from its first call on (replaying what was
    published before it joined)."""

    def __init__(self, replica: ReplicaServer, seen: list):
        self.ranking, self.stats = AffinityRanking(imbalance=2), replica.routing_stats()
        self.calls = 0

    def choose(self, loads: dict[str, int], request) -> str:
        self.calls += 1
        stats = {"home": self.stats, "away": {k: self.stats[k] for k in ("block_size", "prefix_cache_scope")}}
        ranks = self.ranking.rank([(name, name, load, stats[name]) for name, load in loads.items()], [request],
                                  self.calls)
        return ranks[0][0]

    def forget(self, name: str) -> None:
        self.ranking.forget(name)  # closes its sockets


async def _routes(tiny, transport: str) -> list[str]:
    """Where PROMPT goes after a replica "home" ran it, by `transport`'s routing."""
    cfg = EngineConfig(tiny, block_size=BS, max_model_len=128,
                       kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:*",
                                         "replay_endpoint": "tcp://*:*"})
    replica = ReplicaServer(cfg, None, "home", "127.0.0.1")
    seen = []
    replica.engine.kv_event_sinks.append(seen.extend)
    router = (ProcessRouting if transport == "processes" else RayRouting)(replica, seen)
    try:
        request = replica.engine.inputs.request(PROMPT, SamplingParams(max_tokens=4, seed=1))
        items = [item async for item in replica.generate([request])]
        assert items[0] == ("added",) and items[-1][2].finished
        deadline = time.monotonic() + 10
        while (home := router.choose({"home": 2, "away": 0}, request)) != "home" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # Ray's follower reads the events off the socket meanwhile
        return [home, router.choose({"home": 3, "away": 0}, request)]
    finally:
        router.forget("home")
        await replica.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_prompt_goes_to_the_replica_whose_kv_events_cached_it(tiny, transport):
    """Within `imbalance` of the least loaded, the replica that stored the prompt's blocks; past it,
    the least loaded."""
    assert asyncio.run(_routes(tiny, transport)) == ["home", "away"]


@pytest.mark.parametrize("wire", [False, True], ids=["from_the_process", "off_the_socket"])
def test_routed_requests_evictions_and_a_cleared_cache_move_the_match(tiny, wire):
    """The index a transport feeds: a burst follows its first request before any event of it, and a
    replica's evictions and cleared cache take its blocks away, in either form the events come."""
    with LLM(tiny, block_size=BS, max_model_len=128) as llm:
        engine = llm.llm_engine
        events = []
        engine.kv_event_sinks.append(events.extend)
        request = engine.inputs.request(PROMPT, SamplingParams(max_tokens=4, seed=1))
        llm.generate([PROMPT], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)
        stats = engine.stats()
    carry = (lambda evs: decode_batch(encode_batch(time.time(), evs, 0, "map"))) if wire else hashed
    keys = prompt_block_keys(request, stats.block_size, stats.prefix_cache_scope)
    assert len(keys) == 2
    routing = ReplicaRouting(imbalance=2)
    idle = [("home", 2, 10), ("away", 0, 10)]
    routing.routed("away", keys)
    assert routing.choose(idle, keys) == "away"
    routing.ended("away", keys)
    assert routing.index("away").match(keys) == 0

    routing.events("home", carry(events))
    assert routing.choose(idle, keys) == "home"
    [stored] = [e for e in events if isinstance(e, BlockStored)]
    routing.events("home", carry([BlockRemoved([stored.block_hashes[1]])]))
    assert routing.index("home").match(keys) == 1
    routing.events("home", carry([AllBlocksCleared()]))
    assert routing.index("home").match(keys) == 0
    routing.events("home", carry(events))
    routing.forget("home")  # restarted with an empty cache
    assert routing.choose(idle, keys) == "away"


def test_ray_serve_imports_nothing_of_the_engine_but_the_remote_clients_ray_transport():
    """entrypoints/ray_serve.py declares the deployments; what they run lives in the engine behind
    one module (read from its source: importing it needs Ray)."""
    path = importlib.util.find_spec("blockdiff.entrypoints.ray_serve").origin
    with open(path) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    engine = {name for name in imported if name == "blockdiff.engine" or name.startswith("blockdiff.engine.")}
    assert engine == {"blockdiff.engine.ray_transport"}


def _follower_cpu_seconds() -> float:
    """CPU time so far of this process's KV-event follower threads (Linux's per-thread counters)."""
    ticks = 0
    for t in threading.enumerate():
        if t.name == "blockdiff-kv-follower" and t.native_id is not None:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread CPU time from Linux's /proc")
def test_a_follower_without_replicas_waits_instead_of_spinning():
    """Before it follows a replica (and after it forgot the last), the router's follower has no
    socket to poll, and zmq's poll returns at once there: it waits for a replica instead."""
    AffinityRanking(imbalance=2)
    time.sleep(0.2)
    before = _follower_cpu_seconds()
    time.sleep(1.0)
    assert _follower_cpu_seconds() - before < 0.2
