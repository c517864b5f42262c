"""KV cache blocks of one layer kind: who holds which, and which hold a cached prefix.

A block is held by reference: a request that reuses a cached prefix shares its blocks with the
requests that computed or reuse them. A block nobody holds is free; if it holds a full block of
committed tokens it keeps them, under its hash, until it is reused for something else. Free blocks
are handed out from the front of the free queue: blocks without a hash first, then cached ones in
least-recently-freed order, so a cached prefix survives as long as memory allows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from blockdiff.engine.kv_events import AllBlocksCleared, KVEvent, removed

# A block's identity: SHA-256 over its parent block's key (none for the first) and its token ids
# (an image's soft tokens: the image's digest, Request.key_tokens). A block that another request
# computed is read only under this key, so nobody can make a request read K/V of tokens it does
# not have without a SHA-256 collision; Python's hash() of a tuple, used before, is predictable
# and collides on purpose-built inputs (vLLM moved to SHA-256 after CVE-2025-25183). It costs
# about a microsecond a block of 16 tokens (benchmarks/prefix_hash.py). Only rank 0's engine
# hashes (the workers get block tables).
BlockKey = bytes


def _block_bytes(tokens: list[int | bytes]) -> bytes:
    """The tokens of a block, unambiguously: 8 bytes an id, or a tag and 8 bytes or 32 an entry
    when an image's digest is among them."""
    try:
        return b"t" + array("q", tokens).tobytes()
    except TypeError:  # a digest among them
        return b"m" + b"".join(b"d" + t if isinstance(t, bytes) else b"i" + t.to_bytes(8, "little", signed=True)
                               for t in tokens)


def block_keys(tokens: list[int | bytes], block_size: int, parent: BlockKey = b"") -> list[BlockKey]:
    """The key of each full block of `tokens`, chained from the key `parent` of the block before."""
    out = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + _block_bytes(tokens[i : i + block_size])).digest()
        out.append(parent)
    return out


def key_root(cache_salt: str | None, client: str | None, scope: str, adapter: tuple | None = None) -> BlockKey:
    """The key a request's first block chains from: the digest of its cache_salt, else of its
    client's identity when the cache is kept per client (scope "client"), else none. A prefix is
    found only under the same root, so cached_tokens tells one tenant nothing of another's prompts.
    `adapter`: the request's adapter's key (inputs.py Adapter: its kind first), whose K/V differ
    from the base model's: its own root over the rest."""
    if adapter is not None:
        return hashlib.sha256("\0".join(map(str, adapter)).encode() + b"\0"
                              + key_root(cache_salt, client, scope)).digest()
    if cache_salt is not None:
        return hashlib.sha256(b"cache_salt\0" + cache_salt.encode()).digest()
    if scope == "client" and client is not None:
        return hashlib.sha256(b"client\0" + client.encode()).digest()
    return b""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.refs = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}  # key -> block holding it
        self.key_of: dict[int, BlockKey] = {}
        self.events: list[KVEvent] | None = None  # where evictions and clears are recorded, if anywhere

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now, cached ones included (they are evicted on demand)."""
        return len(self.free_queue)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise RuntimeError(f"KV cache exhausted: {n} blocks asked, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            key = self.key_of.pop(block, None)
            if key is not None:  # evicted: its cached tokens are gone
                del self.cached[key]
                if self.events is not None:
                    removed(self.events, key)
            self.refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free queue. Give a
        request's blocks last first: then its tail, the least likely to be shared, is evicted first."""
        for b in blocks:
            if self.refs[b] <= 0:
                raise RuntimeError(f"block {b} released twice")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_queue[b] = None
                if b not in self.key_of:  # nothing worth keeping: hand it out before cached blocks
                    self.free_queue.move_to_end(b, last=False)

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key) if self.caching else None

    def share(self, block: int) -> None:
        """Take a reference to a cached block (a prefix hit)."""
        if self.refs[block] == 0:
            del self.free_queue[block]
        self.refs[block] += 1

    def forget(self) -> None:
        """The blocks' contents are gone (new workers, an empty cache): no block holds a prefix now."""
        self.cached.clear()
        self.key_of.clear()
        if self.events is not None and self.caching:
            self.events.append(AllBlocksCleared())

    def register(self, block: int, key: BlockKey) -> bool:
        """`block` now holds the full block `key`; if another block already does, that one stays cached.
        -> whether `block` was registered."""
        if self.caching and key not in self.cached and block not in self.key_of:
            self.cached[key] = block
            self.key_of[block] = key
            return True
        return False
