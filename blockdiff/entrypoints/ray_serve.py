"""blockdiff on Ray Serve: the OpenAI routes of `blockdiff serve` as a Ray Serve application that any
Ray cluster runs, replicas across machines (docs/scaling.md).

    serve run blockdiff.entrypoints.ray_serve:build_openai_app      (args from a config file)
    serve.run(build_openai_app({"engine": {...}, "server": {...}, "deployment": {...}}))

This module declares the deployments; what they run is the Ray transport of the engine's remote
client (engine/ray_transport.py), whose routing is that of `--data-parallel-size`. Two
deployments, the shape Ray Serve LLM gives vLLM:
- `EngineReplica`: one engine per replica (its tensor-parallel group started under it), placed with
  its devices through a placement group (one bundle, STRICT_PACK: the group's processes run on the
  replica's node), autoscaled on queue length (Ray's ongoing requests: the API calls queued for and
  running on a replica, target `max_num_seqs` each by default). It publishes its KV events
  (engine/kv_events.py) on ZMQ ports of its own and names them in its routing stats.
- `OpenAIIngress`: entrypoints/openai/server.py's app over a `RayEngineClient`, which resolves and
  prices requests as the data-parallel front end does and sends each API call to an engine replica
  through a deployment handle whose request router is `PrefixAffinityRouter`: it follows every
  replica's KV events and ranks first the replica that caches the longest prefix of the call's
  first prompt, then the others, among which Ray takes the shortest queue.

ray.serve.llm is not used: with Ray 2.60 it does not import without vLLM or SGLang (its OpenAI
protocol models are theirs, and the `ray[llm]` extra pins vllm), and its KV-aware router needs
NVIDIA Dynamo's selection service. This module uses Ray Serve's public APIs only: deployments,
`serve.ingress`, deployment handles and `ray.serve.request_router.RequestRouter`.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import fields

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from blockdiff.chat_parts import MediaPolicy
from blockdiff.config import EngineConfig
from blockdiff.engine.ray_transport import AffinityRanking, RayEngineClient, ReplicaServer, default_imbalance
from blockdiff.entrypoints.openai.config import ServerConfig
from blockdiff.entrypoints.openai.server import build_app
from blockdiff.hub import resolve_model

ROUTING_STATS_PERIOD_S = 1.0  # how often Ray collects each replica's routing stats (its KV event endpoints, its load)


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
    """One engine (engine/ray_transport.py's ReplicaServer), serving API calls through `generate`."""

    async def __init__(self, engine: dict, max_queued_requests: int | None = None):
        self.server = ReplicaServer(engine_config(engine), max_queued_requests,
                                    serve.get_replica_context().replica_id.unique_id, ray.util.get_node_ip_address())

    def handshake(self):
        return self.server.handshake()

    async def generate(self, requests: list):
        async with aclosing(self.server.generate(requests)) as items:  # Ray cancelling the call ends it there too
            async for item in items:
                yield item

    def record_routing_stats(self) -> dict:
        """What the router reads of this replica (Ray calls it every ROUTING_STATS_PERIOD_S)."""
        return self.server.routing_stats()

    def check_health(self) -> None:
        """Ray replaces a replica whose engine failed for good (its workers could not be restarted)."""
        self.server.check_health()

    async def __del__(self):
        await self.server.stop()


# ---- the request router -------------------------------------------------------------------------------
class PrefixAffinityRouter(RequestRouter):
    """Ranks the replica that caches the longest prefix of the call's first prompt first (from the
    replicas' own KV events), else the least loaded; Ray then takes the shortest queue in the first
    rank with room. `imbalance`: how many more ongoing calls than the least loaded replica a replica
    with a matching prefix may have and still be preferred."""

    def initialize_state(self, imbalance: int):
        self._ranking = AffinityRanking(imbalance)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        lengths = self.replica_queue_len_cache
        replicas = [(r, r.replica_id.unique_id, lengths.get(r.replica_id) or 0, r.routing_stats or {})
                    for r in candidate_replicas]
        if pending_request is None:
            return self._ranking.rank(replicas, [], None)
        return self._ranking.rank(replicas, pending_request.args[0] if pending_request.args else [],
                                  pending_request.metadata.internal_request_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._ranking.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._ranking.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ranking.forget(replica_id.unique_id)


# ---- the ingress ------------------------------------------------------------------------------------
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
