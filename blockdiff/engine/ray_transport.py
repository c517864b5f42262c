"""The Ray transport of the remote engine client (remote_client.py): what entrypoints/ray_serve.py's
deployments run, with nothing of Ray imported here (the deployments pass in what Ray gives them).

- `ReplicaServer`: one engine behind an engine replica. It answers each API call with items, so
  that no exception has to cross Ray's pickling: ("added",) or ("refused", error) first, then
  ("out", index, output, replica, its stats) for each output and ("error", error) if the call
  failed. Its routing stats name the ZMQ endpoints of its KV events (kv_events.py).
- `AffinityRanking`: the ranking of the request router, by prefix_router.py's `ReplicaRouting`, the
  routing of `--data-parallel-size`: the replica that caches the longest prefix of the call's first
  prompt first, then the others, among which Ray takes the shortest queue. An `EventFollower`
  feeds it every replica's KV events off their sockets.
- `RayEngineClient`: the ingress's client; each API call goes to a replica through a deployment
  handle (routed by the ranking); the replicas' stats are those their last outputs carried.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Hashable, Sequence

from blockdiff.config import EngineConfig
from blockdiff.engine.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from blockdiff.engine.client import EngineStats, structured_specs
from blockdiff.engine.core_process import Handshake, error_of, wire_error
from blockdiff.engine.kv_events import decode_batch
from blockdiff.engine.prefix_router import ReplicaRouting, default_imbalance, prompt_block_keys
from blockdiff.engine.remote_client import RemoteClient
from blockdiff.engine.startup import start_engine
from blockdiff.inputs import EngineRequest

__all__ = ["AffinityRanking", "EventFollower", "RayEngineClient", "ReplicaServer", "default_imbalance"]

log = logging.getLogger(__name__)

_REPLAY_TIMEOUT_MS = 5000


# ---- the engine replicas ----------------------------------------------------------------------------
class ReplicaServer:
    """One engine, serving API calls through `generate`; `name`: the replica's id among the
    others, `host`: its node's address, where the cluster reaches its KV events."""

    def __init__(self, cfg: EngineConfig, max_queued_requests: int | None, name: str, host: str):
        self.engine = start_engine(cfg)
        self.client = AsyncEngine(self.engine, max_queued_requests)
        self.client.start()
        self.name, self.host = name, host

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

    def routing_stats(self) -> dict:
        """What the router reads of this replica."""
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
        """Raises when the engine failed for good (its workers could not be restarted)."""
        if self.client.dead or self.client.error is not None:
            raise RuntimeError(self.client.unavailable_reason())

    async def stop(self) -> None:
        await self.client.stop()


def _reachable(endpoint: str, host: str) -> str:
    """A bound endpoint (tcp://0.0.0.0:PORT) as others on the cluster reach it."""
    base, _, port = endpoint.rpartition(":")
    bound = base.removeprefix("tcp://")
    return f"tcp://{host if bound in ('0.0.0.0', '*', '[::]', '::') else bound}:{port}"


# ---- the request router's ranking ---------------------------------------------------------------------
class AffinityRanking:
    """Ranks a call's candidate replicas: the one that caches the longest prefix of the call's first
    prompt first (from the replicas' own KV events), else the least loaded, then the rest.
    `imbalance`: how many more ongoing calls than the least loaded replica a replica with a
    matching prefix may have and still be preferred."""

    def __init__(self, imbalance: int):
        self.routing = ReplicaRouting(imbalance)
        self._events = EventFollower(self.routing)
        self._expected: dict[Hashable, tuple[str, tuple]] = {}  # call id -> (replica, block keys)

    def rank(self, replicas: Sequence[tuple[object, str, int, dict]], requests: list[EngineRequest],
             call: Hashable | None) -> list[list]:
        """`replicas`: (replica, its name, its ongoing calls, its routing stats) each; `requests`:
        the call's; `call`: its id, for `routed` and `completed`. -> the replicas in ranks."""
        if not replicas:
            return []
        block_size, scope = None, "client"
        for _, name, _, stats in replicas:
            self._events.follow(name, stats)
            block_size = block_size or stats.get("block_size")
            scope = stats.get("prefix_cache_scope", scope)
        keys = prompt_block_keys(requests[0], block_size, scope) if requests and block_size else ()
        name = self.routing.choose([(n, load, stats.get("free_blocks", 0)) for _, n, load, stats in replicas], keys)
        chosen = next(r for r, n, _, _ in replicas if n == name)
        rest = [r for r, n, _, _ in replicas if n != name]
        if call is not None and keys:
            self._expected[call] = (name, keys)
        return [[chosen], rest] if rest else [[chosen]]

    def routed(self, call: Hashable, name: str) -> None:
        """Ray sent `call` to `name` (another rank than the first when the chosen one was full)."""
        entry = self._expected.get(call)
        if entry is not None:
            self._expected[call] = (name, entry[1])
            self.routing.routed(name, entry[1])

    def completed(self, call: Hashable) -> None:
        entry = self._expected.pop(call, None)
        if entry is not None:
            self.routing.ended(*entry)

    def forget(self, name: str) -> None:
        self._events.forget(name)


class EventFollower:
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
            # zmq's poll returns at once when it has no socket: with no replica followed, wait for one.
            changes = [] if followed else [self._changes.get()]
            while not self._changes.empty():
                changes.append(self._changes.get())
            for change in changes:
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


# ---- the ingress's client ------------------------------------------------------------------------------
class RayEngineClient(RemoteClient):
    """The client of the ingress: each API call goes to an engine replica through `handle`, a
    deployment handle whose router ranks by AffinityRanking."""

    def __init__(self, handle, cfg: EngineConfig, hs: Handshake):
        super().__init__(cfg, hs, hs.cache_tokens)
        self._handle = handle.options(stream=True)
        self._stats: dict[str, EngineStats] = {}
        self._calls: dict[str, tuple] = {}  # request id -> (its call's generator, its pump)
        self._ids = itertools.count()
        self._open = False

    def engine_stats(self) -> dict[str, EngineStats]:
        return dict(self._stats)

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
