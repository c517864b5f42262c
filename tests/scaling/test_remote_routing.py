"""The routing of a remote engine client's replicas (engine/prefix_router.py's ReplicaRouting), run
once for each transport: the engine's KV events reach it as the data-parallel front end gets them
from a replica's process, and as Ray Serve's router reads them off a replica's ZMQ socket."""

from __future__ import annotations

import ast
import importlib.util
import time

import pytest

from blockdiff import LLM, SamplingParams
from blockdiff.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch, hashed
from blockdiff.engine.prefix_router import ReplicaRouting, prompt_block_keys

BS = 16
PROMPT = [(11 * i) % 280 + 10 for i in range(40)]  # two full blocks and a tail

TRANSPORTS = {
    "processes": hashed,  # core_process's ("kv", events), as dp_client applies them
    "ray": lambda events: decode_batch(encode_batch(time.time(), events, 0, "map")),  # the PUB socket's payload
}


@pytest.fixture(scope="module")
def served(tiny):
    """A real engine's KV events after it ran PROMPT, its block size and scope, and PROMPT's request."""
    with LLM(tiny, block_size=BS, max_model_len=128) as llm:
        engine = llm.llm_engine
        events = []
        engine.kv_event_sinks.append(events.extend)
        request = engine.inputs.request(PROMPT, SamplingParams(max_tokens=4, seed=1))
        llm.generate([PROMPT], SamplingParams(max_tokens=4, seed=1), use_tqdm=False)
        stats = engine.stats()
        yield events, stats.block_size, stats.prefix_cache_scope, request


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_a_prompt_goes_to_the_replica_whose_events_cached_it(served, transport):
    events, block_size, scope, request = served
    keys = prompt_block_keys(request, block_size, scope)
    assert len(keys) == 2
    routing = ReplicaRouting(imbalance=2)
    routing.events("home", TRANSPORTS[transport](events))
    idle = [("home", 2, 10), ("away", 0, 10)]
    assert routing.choose(idle, keys) == "home"  # its two blocks, within the imbalance
    assert routing.choose([("home", 3, 10), ("away", 0, 10)], keys) == "away"  # affinity yields to load

    # A burst follows its first request to the replica it was routed to, before any event of it.
    routing.forget("home")  # restarted with an empty cache
    routing.routed("away", keys)
    assert routing.choose(idle, keys) == "away"
    routing.ended("away", keys)
    assert routing.index("away").match(keys) == 0

    # Evictions and a cleared cache, as the replica reports them.
    routing.events("home", TRANSPORTS[transport](events))
    [stored] = [e for e in events if isinstance(e, BlockStored)]
    routing.events("home", TRANSPORTS[transport]([BlockRemoved([stored.block_hashes[1]])]))
    assert routing.index("home").match(keys) == 1
    routing.events("home", TRANSPORTS[transport]([AllBlocksCleared()]))
    assert routing.index("home").match(keys) == 0


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
