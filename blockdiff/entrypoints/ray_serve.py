"""blockdiff on Ray Serve: the OpenAI routes of `blockdiff serve` as a Ray Serve application that any
Ray cluster runs, replicas across machines (docs/scaling.md).

    serve run blockdiff.entrypoints.ray_serve:build_openai_app      (args from a config file)
    serve.run(build_openai_app({"engine": {...}, "server": {...}, "deployment": {...}}))

Two deployments, the shape Ray Serve LLM gives vLLM:
- `EngineReplica`: one engine per replica (its tensor-parallel group started under it), placed with
  its devices through a placement group (one bundle, STRICT_PACK: the group's processes run on the
  replica's node), autoscaled on queue length (Ray's ongoing requests: the API calls queued for and
  running on a replica, target `max_num_seqs` each by default). It publishes its KV events
  (engine/kv_events.py) on ZMQ ports of its own and names them in its routing stats.
- `OpenAIIngress`: entrypoints/openai/server.py's app over a `RayEngineClient`, which resolves and
  prices requests as a data-parallel front end does (dp_client.FrontEnd) and sends each API call to
  an engine replica through a deployment handle whose request router is `PrefixAffinityRouter`: it
  follows every replica's KV events and ranks first the replica that caches the longest prefix of
  the call's first prompt (engine/prefix_router.py, the policy of `--data-parallel-size`), then the
  others, among which Ray takes the shortest queue.

ray.serve.llm is not used: with Ray 2.60 it does not import without vLLM or SGLang (its OpenAI
protocol models are theirs, and the `ray[llm]` extra pins vllm), and its KV-aware router needs
NVIDIA Dynamo's selection service. This module uses Ray Serve's public APIs only: deployments,
`serve.ingress`, deployment handles and `ray.serve.request_router.RequestRouter`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import fields

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from blockdiff.chat_parts import MediaPolicy
from blockdiff.config import EngineConfig
from blockdiff.engine.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from blockdiff.engine.client import EngineClient, EngineStats, structured_specs
from blockdiff.engine.core_process import Handshake, error_of, wire_error
from blockdiff.engine.dp_client import FrontEnd
from blockdiff.engine.kv_events import decode_batch
from blockdiff.engine.prefix_router import ReplicaRouting, default_imbalance, prompt_block_keys
from blockdiff.entrypoints.openai.config import ServerConfig
from blockdiff.entrypoints.openai.server import build_app
from blockdiff.hub import resolve_model
from blockdiff.inputs import EngineRequest
from blockdiff.sampling_params import StructuredOutputsParams
from blockdiff.engine.startup import start_engine

log = logging.getLogger(__name__)

ROUTING_STATS_PERIOD_S = 1.0  # how often Ray collects each replica's routing stats (its KV event endpoints, its load)
_REPLAY_TIMEOUT_MS = 5000


def engine_config(args: dict) -> EngineConfig:
    """EngineConfig from a dict of its fields; `model` may be a Hugging Face id in the local cache,
    or missing: the demo. Each replica publishes its KV events on free ports unless told where."""
    args = dict(args)
    model = resolve_model(args.pop("model", None), args.pop("download_dir", None))
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"engine: unknown field {unknown[0]!r} (EngineConfig's fields: {', '.join(sorted(known))})")
    args.setdefault("kv_events_config", {"enable_kv_cache_events": True, "endpoint": "tcp://*:*",
                                          "replay_endpoint": "tcp://*:*"})
    return EngineConfig(model=model, **args)


# ---- the engine replicas ----------------------------------------------------------------------------
class EngineReplica:
    """One engine, serving API calls through `generate`. Its items, so that no exception has to
    cross Ray's pickling: ("added",) or ("refused", error) first, then ("out", index, output,
    replica, its stats) for each output and ("error", error) if the call failed."""

    async def __init__(self, engine: dict, max_queued_requests: int | None = None):
        self.cfg = engine_config(engine)
        self.engine = start_engine(self.cfg)
        self.client = AsyncEngine(self.engine, max_queued_requests)
        self.client.start()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.host = ray.util.get_node_ip_address()

    def handshake(self) -> Handshake:
        return Handshake.of(self.engine)

    async def generate(self, requests: list[EngineRequest]):
        try:
            # A new structured output's automaton is built off this replica's loop first.
            for spec in structured_specs(requests):
                await self.client.prepare(spec, requests[0].client)
            stream = await self.client.add(requests)
        except Exception as e:
            yield ("refused", wire_error(e))
            return
        yield ("added",)
        try:
            async for index, out in stream:
                yield ("out", index, out, self.name, self.engine.stats())
        except Exception as e:
            yield ("error", wire_error(e))
        finally:
            stream.abort()  # the caller went away (Ray cancels this generator), or it is done: a no-op

    def record_routing_stats(self) -> dict:
        """What the router reads of this replica (Ray calls it every ROUTING_STATS_PERIOD_S)."""
        stats = self.engine.stats()
        out = {"block_size": stats.block_size, "prefix_cache_scope": stats.prefix_cache_scope,
               "free_blocks": stats.kv_cache_free_blocks,
               "running": stats.num_running, "waiting": stats.num_waiting}
        publisher = self.engine.kv_publisher
        if publisher is not None and publisher.endpoint.startswith("tcp://"):
            out["kv_events"] = _reachable(publisher.endpoint, self.host)
            out["kv_topic"] = publisher.cfg.topic
            if publisher.replay_endpoint:
                out["kv_replay"] = _reachable(publisher.replay_endpoint, self.host)
        return out

    def check_health(self) -> None:
        """Ray replaces a replica whose engine failed for good (its workers could not be restarted)."""
        if self.client.dead or self.client.error is not None:
            raise RuntimeError(self.client.unavailable_reason())

    async def __del__(self):
        await self.client.stop()


def _reachable(endpoint: str, host: str) -> str:
    """A bound endpoint (tcp://0.0.0.0:PORT) as others on the cluster reach it."""
    base, _, port = endpoint.rpartition(":")
    bound = base.removeprefix("tcp://")
    return f"tcp://{host if bound in ('0.0.0.0', '*', '[::]', '::') else bound}:{port}"


# ---- the request router -------------------------------------------------------------------------------
class PrefixAffinityRouter(RequestRouter):
    """Ranks the replica that caches the longest prefix of the call's first prompt first (from the
    replicas' own KV events), else the least loaded; Ray then takes the shortest queue in the first
    rank with room. `imbalance`: how many more ongoing calls than the least loaded replica a replica
    with a matching prefix may have and still be preferred."""

    def initialize_state(self, imbalance: int):
        self._routing = ReplicaRouting(imbalance)
        self._events = _EventFollower(self._routing)
        self._expected: dict[str, tuple[str, tuple]] = {}  # internal request id -> (replica, block keys)

    def _keys(self, pending: PendingRequest | None, block_size: int | None, scope: str) -> tuple:
        if pending is None or not pending.args or not block_size:
            return ()
        requests = pending.args[0]
        if not requests:
            return ()
        return prompt_block_keys(requests[0], block_size, scope)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        block_size, scope = None, "client"
        for r in candidate_replicas:
            stats = r.routing_stats or {}
            self._events.follow(r.replica_id.unique_id, stats)
            block_size = block_size or stats.get("block_size")
            scope = stats.get("prefix_cache_scope", scope)
        keys = self._keys(pending_request, block_size, scope)
        lengths = self.replica_queue_len_cache
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        name = self._routing.choose([(n, lengths.get(r.replica_id) or 0, (r.routing_stats or {}).get("free_blocks", 0))
                                     for n, r in by_name.items()], keys)
        chosen = by_name[name]
        rest = [r for r in candidate_replicas if r is not chosen]
        if pending_request is not None and keys:
            self._expected[pending_request.metadata.internal_request_id] = (name, keys)
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        entry = self._expected.get(pending_request.metadata.internal_request_id)
        if entry is None:
            return
        if entry[0] != replica_id.unique_id:  # Ray took another rank (the chosen one was full)
            entry = self._expected[pending_request.metadata.internal_request_id] = (replica_id.unique_id, entry[1])
        self._routing.routed(*entry)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        entry = self._expected.pop(internal_request_id, None)
        if entry is not None:
            self._routing.ended(*entry)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._events.forget(replica_id.unique_id)


class _EventFollower:
    """Feeds `routing` each replica's KV events: a thread subscribes to each replica's PUB socket,
    replays from sequence 0 what was published before it joined, and replays again whenever a gap
    in the sequence numbers shows a batch was missed."""

    def __init__(self, routing: ReplicaRouting):
        self.routing = routing
        self._followed: set[str] = set()
        self._changes: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="blockdiff-kv-follower", daemon=True).start()

    def follow(self, name: str, stats: dict) -> None:
        if name in self._followed or "kv_events" not in stats:
            return
        self._followed.add(name)
        self._changes.put(("follow", name, stats["kv_events"], stats.get("kv_replay"), stats.get("kv_topic", "")))

    def forget(self, name: str) -> None:
        self._followed.discard(name)
        self.routing.forget(name)
        self._changes.put(("forget", name))

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        poller = zmq.Poller()
        followed: dict = {}  # SUB socket -> [name, next sequence, replay endpoint]
        while True:
            while not self._changes.empty():
                change = self._changes.get()
                if change[0] == "forget":
                    for sock in [s for s, f in followed.items() if f[0] == change[1]]:
                        poller.unregister(sock)
                        sock.close(linger=0)
                        del followed[sock]
                    continue
                _, name, endpoint, replay, topic = change
                sock = ctx.socket(zmq.SUB)
                sock.connect(endpoint)
                sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
                poller.register(sock, zmq.POLLIN)
                followed[sock] = [name, 0, replay]
                self._replay(ctx, followed[sock])
            for sock, _ in poller.poll(100):
                _, seq, payload = sock.recv_multipart()
                state = followed[sock]
                seq = int.from_bytes(seq, "big")
                if seq > state[1]:
                    self._replay(ctx, state)
                if seq == state[1]:
                    self._apply(state, payload)

    def _replay(self, ctx, state: list) -> None:
        """Ask the replica's replay socket for every batch from state's next sequence number on."""
        import zmq

        name, first, endpoint = state
        if endpoint is None:
            return
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, _REPLAY_TIMEOUT_MS)
        sock.connect(endpoint)
        try:
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            while True:
                _, seq, payload = sock.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return
                if int.from_bytes(seq, "big") == state[1]:
                    self._apply(state, payload)
        except zmq.Again:
            log.warning("replica %s did not answer a KV event replay in time", name)
        finally:
            sock.close(linger=0)

    def _apply(self, state: list, payload: bytes) -> None:
        self.routing.events(state[0], decode_batch(payload))
        state[1] += 1


# ---- the ingress ------------------------------------------------------------------------------------
class RayEngineClient(EngineClient):
    """The EngineClient of the ingress: each API call goes to an engine replica through `handle`
    (routed by PrefixAffinityRouter); the replicas' stats are those their last outputs carried."""

    def __init__(self, handle, cfg: EngineConfig, hs: Handshake):
        self._handle = handle.options(stream=True)
        front = FrontEnd(cfg, hs, hs.cache_tokens)
        self.limits, self.defaults, self.tokenizer, self.sampler, self.mm = (
            front.limits, front.defaults, front.tokenizer, front.sampler, front.mm)
        self.inputs = front.inputs
        self._stats: dict[str, EngineStats] = {}
        self._calls: dict[str, tuple] = {}  # request id -> (its call's generator, its pump)
        self._ids = itertools.count()
        self._open = False
        self.on_step = lambda seconds, engine="0": None
        self.on_finish = lambda finish_reason, prompt_tokens, generated_tokens, metrics, engine="0": None

    def engine_stats(self) -> dict[str, EngineStats]:
        return dict(self._stats)

    async def prepare(self, spec: StructuredOutputsParams, client: str | None = None) -> None:
        """Nothing here: the replica a call goes to builds its automaton before it adds the call
        (EngineReplica.generate), and a spec it cannot serve comes back as the call's InvalidParam."""

    async def add(self, requests: list[EngineRequest]) -> RequestStream:
        if not self._open:
            raise EngineUnavailable(self.unavailable_reason())
        stream = RequestStream(self, [f"req-{next(self._ids)}" for _ in requests])
        generator = self._handle.generate.remote(requests)
        try:
            first = await generator.__anext__()
        except asyncio.CancelledError:
            generator.cancel()
            raise
        except Exception as e:
            raise EngineUnavailable(f"no engine replica took the request ({type(e).__name__}: {e}); retry") from None
        if first[0] == "refused":
            raise error_of(first[1])
        pump = asyncio.get_running_loop().create_task(self._pump(generator, stream))
        for rid in stream.request_ids:
            self._calls[rid] = (generator, pump)
        return stream

    async def _pump(self, generator, stream: RequestStream) -> None:
        try:
            async for item in generator:
                if item[0] == "error":
                    stream._put(error_of(item[1]))
                    continue
                _, index, out, replica, stats = item
                self._stats[replica] = stats
                out.request_id = stream.request_ids[index]
                if out.finished:
                    self.on_finish(out.finish_reason, len(out.prompt_token_ids), out.metrics["committed_tokens"],
                                   out.metrics, replica)
                stream._put(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the replica died under the call
            stream._put(EngineUnavailable(f"the engine replica was lost while this request ran ({type(e).__name__}); "
                                          "retry"))
        finally:
            for rid in stream.request_ids:
                self._calls.pop(rid, None)

    def abort(self, request_ids: list[str]) -> None:
        for generator, pump in {self._calls[rid] for rid in request_ids if rid in self._calls}:
            generator.cancel()
            pump.cancel()

    @property
    def available(self) -> bool:
        return self._open

    @property
    def dead(self) -> bool:
        return False  # Ray replaces failed replicas

    def unavailable_reason(self) -> str:
        return "the server is shutting down" if not self._open else ""

    def start(self) -> None:
        self._open = True

    def drain_threadsafe(self, grace: float) -> None:
        self._open = False

    async def stop(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self._open = False
        for rid in list(self._calls):
            self.abort([rid])


@serve.ingress()
class OpenAIIngress:
    """The OpenAI routes of `blockdiff serve`, over the engine replicas behind `engine`."""

    async def __init__(self, engine, engine_args: dict, server: dict):
        hs = await engine.handshake.remote()
        cfg = engine_config(engine_args)
        self.client = RayEngineClient(engine, cfg, hs)
        self.server = ServerConfig(**{"served_model_names": [engine_args.get("model") or "demo"], "media": MediaPolicy.of(cfg),
                                      **server})

    def __serve_build_asgi_app__(self):
        return build_app(self.client, self.server)


# ---- the application -----------------------------------------------------------------------------------
def build_openai_app(args: dict) -> serve.Application:
    """The application, from `args` (a `serve run` / `serve deploy` config's `args`):
    - engine: EngineConfig's fields (model: a checkpoint directory, a Hugging Face id in the cache,
      or none for the demo; tensor_parallel_size, max_num_seqs, ...);
    - server: ServerConfig's fields (served_model_names, api_key, max_request_cost, ...);
    - deployment: Ray Serve options of the engine replicas over the defaults (autoscaling from 1
      to 2 replicas on `max_num_seqs` ongoing calls each; num_replicas fixes the count instead);
    - router: PrefixAffinityRouter's arguments (imbalance)."""
    known = {"engine", "server", "deployment", "router", "max_queued_requests"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"build_openai_app: unknown argument {unknown[0]!r}; it takes {', '.join(sorted(known))}")
    engine_args = dict(args.get("engine") or {})
    cfg = engine_config(engine_args)  # checked here, on the driver, before any replica starts
    if cfg.data_parallel_size != 1:
        raise ValueError("engine: data_parallel_size is Ray's to set here: give deployment.num_replicas or "
                         "deployment.autoscaling_config instead")
    server = dict(args.get("server") or {})
    ServerConfig(**{"served_model_names": ["check"], **server})
    options = _replica_options(cfg, dict(args.get("deployment") or {}), dict(args.get("router") or {}))
    replica = serve.deployment(EngineReplica).options(**options)
    engine = replica.bind(engine_args, args.get("max_queued_requests"))
    return serve.deployment(OpenAIIngress).options(max_ongoing_requests=options["max_ongoing_requests"]).bind(
        engine, engine_args, server)


def _replica_options(cfg: EngineConfig, given: dict, router: dict) -> dict:
    gpus = cfg.tensor_parallel_size if cfg.resolved_device().startswith("cuda") else 0
    bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
    options = {
        "max_ongoing_requests": 4 * cfg.max_num_seqs,
        "ray_actor_options": {"num_cpus": 1, **({"num_gpus": gpus} if gpus else {})},
        # One bundle with the whole tensor-parallel group's GPUs: the replica starts the group's
        # processes itself, on its node, with the GPUs Ray made visible to it.
        "placement_group_bundles": [bundle],
        "placement_group_strategy": "STRICT_PACK",
        "request_router_config": RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                     request_router_kwargs={"imbalance": default_imbalance(cfg.max_num_seqs),
                                                                            **router},
                                                     request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        "health_check_period_s": 10,
    }
    if "num_replicas" not in given:
        options["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": cfg.max_num_seqs}
    options.update(given)
    return options
