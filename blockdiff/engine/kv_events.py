"""The KV cache's block events, and their publication on the wire that vLLM's KV-aware routers read
(llm-d's precise prefix scorer, NVIDIA Dynamo, SGLang's router; Ray Serve here through
ray_transport.py); the data-parallel front end (dp_client.py) routes by the same events, which its
replicas' processes hand it.

The prefix cache (kv_cache_manager.py) records an event when a full block of committed tokens is
registered under its key (`BlockStored`), when a cached block is evicted to hold something else
(`BlockRemoved`) and when every cached prefix is forgotten, after the workers were restarted
(`AllBlocksCleared`). Only the full-attention pool is reported: a prefix hit needs its full blocks
from the first token on, while the sliding layers need only the blocks of the last window before
the hit's end (and are sized to outlive their requests a while), so a router that follows the full
blocks sees what can hit; the engine's `cached_tokens` says what did.

The wire, as vLLM's `ZmqEventPublisher` writes it (vllm/distributed/kv_events.py):
- a ZMQ PUB socket sends each batch as three frames: the topic, the batch's sequence number
  (8 bytes, big-endian, from 0) and the msgpack payload;
- the payload is vLLM's `EventBatch`, an array: [ts (seconds since the epoch), events,
  data_parallel_rank];
- each event is a map with its tag under "type" (vLLM since 0.24, `"encoding": "map"`, the default),
  or an array with its tag first (vLLM 0.11 to 0.23, `"encoding": "array"`), with the fields of
  msgspec's structs in their order:
    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                      lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
    BlockRemoved      block_hashes, medium, group_idx
    AllBlocksCleared  (none)
  and msgspec's `omit_defaults`: a field that has a default and holds it is left out (in an array,
  only at the end; the array layout stops at lora_name, as in those versions);
- block hashes are unsigned 64-bit integers: the last 8 bytes of our SHA-256 block key read
  big-endian, as vLLM's `int.from_bytes(digest, "big") & (2**64 - 1)`. They are blockdiff's own
  keys (block_allocator.block_keys), not vLLM's CBOR hashes: a consumer that keys blocks by the
  token ids the events carry (llm-d's request keys, Dynamo's local hashes) needs nothing else;
- `medium` is "GPU", vLLM's name for the engine's own KV cache (on the CPU too: "CPU" means an
  offload tier to these consumers);
- a ROUTER socket (`replay_endpoint`) answers [identity, b"", start sequence (8 bytes big-endian)]
  with every buffered batch from that number on, [identity, b"", sequence, payload] each, then
  [identity, b"", -1 (8 bytes, signed), b""]. A peer address gets 4 replays a second (more are
  answered with the end marker alone), one replay is served per batch published, and a request
  over 64 bytes (1 KiB under CURVE, whose handshake is larger) disconnects its peer unread;
- the default endpoint is tcp://<the server's --host>:5557, bound (vLLM's is tcp://*:5557): the
  events carry every client's token ids, so they are for the operator's routers, not the network;
  an endpoint beyond the loopback without CURVE is warned about at start;
- with `curve_clients_dir` (required under `serve --api-key`) both sockets are CURVE servers: the
  wire is encrypted, and pyzmq's ZAP authenticator (zmq.auth) lets in only peers whose public key
  is in that directory; any other gets nothing, not even a refusal;
- replica r (data_parallel_rank) offsets the port of both endpoints by r (an inproc name gets "_dp{r}").
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from blockdiff.config import KVEventsConfig

log = logging.getLogger(__name__)

MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass
class BlockStored:
    block_hashes: list[bytes]  # the keys of consecutive full blocks
    parent_block_hash: bytes | None  # the key of the block before the first; None: it starts the sequence
    token_ids: list[int]  # their tokens, block_size each
    block_size: int
    # Per block, the digests (hex) of the images whose soft tokens it holds, which its key covers
    # instead of their placeholder ids; None for a block of text.
    extra_keys: list[tuple[str, ...] | None] = field(default_factory=list)


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def removed(events: list[KVEvent], key: bytes) -> None:
    """Record an eviction, in one BlockRemoved with the evictions right before it."""
    if events and isinstance(events[-1], BlockRemoved):
        events[-1].block_hashes.append(key)
    else:
        events.append(BlockRemoved([key]))


# ---- the wire ------------------------------------------------------------------------------------
def external_hash(key: bytes) -> int:
    """A block key as vLLM publishes a hash: its low 64 bits, read big-endian."""
    return int.from_bytes(key[-8:], "big")


def _fields(event: KVEvent) -> tuple[str, list[tuple[str, object, bool]]]:
    """-> (tag, [(field, value, whether msgspec would leave it out: a default holding its default)])."""
    if isinstance(event, BlockStored):
        parent = None if event.parent_block_hash is None else external_hash(event.parent_block_hash)
        return "BlockStored", [
            ("block_hashes", [external_hash(k) for k in event.block_hashes], False),
            ("parent_block_hash", parent, False),
            ("token_ids", event.token_ids, False),
            ("block_size", event.block_size, False),
            ("lora_id", None, False),
            ("medium", MEDIUM, False),
            ("lora_name", None, False),
            ("extra_keys", [None if e is None else list(e) for e in event.extra_keys], False),
            ("group_idx", 0, False),
            ("kv_cache_spec_kind", "full_attention", False),
            ("kv_cache_spec_sliding_window", None, True),
        ]
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", [("block_hashes", [external_hash(k) for k in event.block_hashes], False),
                                ("medium", MEDIUM, False), ("group_idx", 0, False)]
    return "AllBlocksCleared", []


# The last field of each event in the array layout (vLLM 0.11 to 0.23).
_ARRAY_LAST = {"BlockStored": "lora_name", "BlockRemoved": "medium", "AllBlocksCleared": None}


def wire_event(event: KVEvent, encoding: str) -> dict | list:
    tag, values = _fields(event)
    if encoding == "map":
        return {"type": tag, **{name: value for name, value, omitted in values if not omitted}}
    last = _ARRAY_LAST[tag]
    out: list = [tag]
    for name, value, _ in values:
        out.append(value)
        if name == last:
            break
    return out


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int, encoding: str) -> bytes:
    import msgpack

    return msgpack.packb([ts, [wire_event(e, encoding) for e in events], data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> list[tuple[str, list[int]]]:
    """A batch as a consumer reads it, in either encoding: -> [(tag, block hashes)] in order."""
    import msgpack

    _, events, *_ = msgpack.unpackb(payload)
    out = []
    for event in events:
        if isinstance(event, dict):
            out.append((event["type"], event.get("block_hashes", [])))
        else:
            out.append((event[0], event[1] if len(event) > 1 else []))
    return out


def hashed(events: list[KVEvent]) -> list[tuple[str, list[int]]]:
    """Events as decode_batch reads them off the wire, without the wire: -> [(tag, block hashes)]."""
    return [(type(e).__name__, [external_hash(k) for k in getattr(e, "block_hashes", ())]) for e in events]


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule: replica r publishes on the endpoint's port + r (an inproc name gets "_dp{r}")."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port == "*":  # any free port: nothing to offset
            return endpoint
        return f"{base}:{int(port) + rank}"
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"kv_events_config endpoint {endpoint!r} must start with tcp://, ipc:// or inproc://")


REPLAY_MAX_BYTES = 64
# The limit covers the handshake's commands too, whose CURVE INITIATE is some 300 bytes.
REPLAY_MAX_BYTES_CURVE = 1024
REPLAYS_PER_PEER, REPLAY_WINDOW_S = 4, 1.0


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes the engine's KV events, one batch per engine step that had any, from a thread of its
    own: `publish` (from the engine's thread) only queues. The sockets are bound here, so that a
    taken port fails at start-up; only the thread uses them after."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq

        self.cfg = cfg
        self.rank = data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self._dropped = 0
        curve = _curve_keys(cfg)
        # A context of its own under CURVE: it holds the one ZAP authenticator a context may have.
        self._ctx = zmq.Context.instance() if curve is None else zmq.Context()
        self._auth = None if curve is None else _authenticator(self._ctx, cfg.curve_clients_dir)
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        self._replays: dict[str, deque[float]] = {}  # peer address -> times of its recent replay requests
        try:
            _serve_curve(self._pub, curve)
            self._pub.set_hwm(cfg.hwm)
            given = cfg.endpoint or default_endpoint(cfg.bind_host)
            endpoint = offset_endpoint(given, data_parallel_rank)
            (self._pub.bind if cfg.endpoint is None or _binds(endpoint) else self._pub.connect)(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
            self.replay_endpoint = None
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                _serve_curve(self._replay, curve)
                # A replay request is 8 bytes: a peer that sends more is disconnected, unread.
                self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_BYTES if curve is None else REPLAY_MAX_BYTES_CURVE)
                self._replay.bind(offset_endpoint(cfg.replay_endpoint, data_parallel_rank))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close()
            raise ValueError(f"kv_events_config: cannot open the endpoint {cfg.endpoint!r} or the replay endpoint "
                             f"{cfg.replay_endpoint!r} (data_parallel_rank {data_parallel_rank}): {e}") from None
        self._thread = threading.Thread(target=self._run, name="blockdiff-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV cache events on %s%s%s", self.endpoint,
                 f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "",
                 "" if curve is None else f", CURVE only, to the keys in {cfg.curve_clients_dir}; the server's public "
                                          f"key (a router's curve_serverkey) is {curve[0].decode()}")
        if curve is None:
            for endpoint in (self.endpoint, self.replay_endpoint):
                if endpoint is not None and not _loopback(endpoint):
                    log.warning("KV events on %s reach beyond this machine in clear, unauthenticated: they carry "
                                "every client's prompt and output token ids; give curve_clients_dir in "
                                "--kv-events-config (with --api-key it is required; docs/scaling.md)", endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (a consumer that falls behind loses batches, which replay resends)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("the KV event queue is full (max_queue_size %d): batches are being dropped",
                            self.cfg.max_queue_size)

    def shutdown(self) -> None:
        """Send what is queued (for at most a second), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(1.0)
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._ctx.term()

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()  # one per batch published: a flood of them cannot stop live events
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            payload = encode_batch(ts, events, self.rank, self.cfg.encoding)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart(copy=False)
        if len(frames) != 3:
            log.warning("ignoring a KV event replay request of %d frames (want 3: identity, empty, sequence)", len(frames))
            return
        identity, start = frames[0].bytes, frames[2].bytes
        if len(start) != 8 or not self._admit(frames[2]):  # answered with the end marker alone
            self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))
            return
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


    def _admit(self, frame) -> bool:
        """At most REPLAYS_PER_PEER replay requests per REPLAY_WINDOW_S seconds from one peer address:
        each resends up to buffer_steps batches."""
        try:
            peer = frame.get("Peer-Address")
        except Exception:  # a transport without peer addresses (ipc://, inproc://): one budget for all
            peer = ""
        now = time.monotonic()
        recent = self._replays.setdefault(peer, deque())
        while recent and now - recent[0] > REPLAY_WINDOW_S:
            recent.popleft()
        if len(recent) >= REPLAYS_PER_PEER:
            return False
        recent.append(now)
        if len(self._replays) > 4096:  # peers come and go: forget the idle ones
            for idle in [p for p, times in self._replays.items() if not times or now - times[-1] > REPLAY_WINDOW_S]:
                del self._replays[idle]
        return True


def _curve_keys(cfg: KVEventsConfig) -> tuple[bytes, bytes] | None:
    """The server's CURVE key pair (public, secret), Z85; None without curve_clients_dir."""
    if cfg.curve_clients_dir is None:
        return None
    import zmq
    import zmq.auth

    if not zmq.has("curve"):
        raise ValueError(f"kv_events_config: curve_clients_dir needs CURVE, which this pyzmq's libzmq "
                         f"{zmq.zmq_version()} was built without (pyzmq's own wheels have it)")
    if not os.path.isdir(cfg.curve_clients_dir) or not zmq.auth.load_certificates(cfg.curve_clients_dir):
        raise ValueError(f"kv_events_config: curve_clients_dir {cfg.curve_clients_dir!r} is not a directory of public "
                         "keys (the *.key files of zmq.auth.create_certificates)")
    if cfg.curve_server_secret_key_file is None:
        return zmq.curve_keypair()
    try:
        public, secret = zmq.auth.load_certificate(cfg.curve_server_secret_key_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"kv_events_config: cannot read curve_server_secret_key_file "
                         f"{cfg.curve_server_secret_key_file!r}: {e}") from None
    if secret is None:
        raise ValueError(f"kv_events_config: curve_server_secret_key_file {cfg.curve_server_secret_key_file!r} has no "
                         "secret key (give the .key_secret file of zmq.auth.create_certificates)")
    return public, secret


def _authenticator(ctx, clients_dir: str):
    """pyzmq's ZAP handler for `ctx`, letting in the CURVE clients whose public keys are in `clients_dir`."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=log.getChild("auth"))
    auth.start()
    auth.configure_curve(domain="*", location=clients_dir)
    return auth


def _serve_curve(sock, keys: tuple[bytes, bytes] | None) -> None:
    """Make `sock` a CURVE server with `keys` (public, secret); None: leave it in clear."""
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_server = True


def _loopback(endpoint: str) -> bool:
    """Whether `endpoint` (a socket's last endpoint) stays on this machine: an ipc:// or inproc://
    one, or tcp:// on a loopback address."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, or a wildcard ("*")
        return host == "localhost"


def default_endpoint(host: str) -> str:
    """tcp://<host>:5557, the address in brackets when it is IPv6."""
    return f"tcp://[{host}]:5557" if ":" in host else f"tcp://{host}:5557"


def make_publisher(cfg: KVEventsConfig | None, data_parallel_rank: int) -> ZmqEventPublisher | None:
    if cfg is None or not cfg.publishes:
        return None
    return ZmqEventPublisher(cfg, data_parallel_rank)
