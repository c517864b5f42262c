"""The block tables of the running requests, one per layer kind, and automatic prefix caching.

A request gets blocks as it grows: those of a prompt chunk when the chunk is scheduled, those of a
canvas when it is committed. Full layers keep every block; a sliding layer's block is given back as
soon as no query of the request can reach it (`past` positions back). Once a block holds
`block_size` committed tokens it is registered under the SHA-256 of its tokens chained to its
parent's key (block_allocator.block_keys), in both pools; a request admitted later reuses the longest registered prefix whose full blocks are
all cached and whose sliding blocks are cached for the last `past` positions before its end.
The full pool's registrations and evictions are recorded as KV events (kv_events.py), which the
engine takes after each step.
"""

from __future__ import annotations

from blockdiff.engine.block_allocator import BlockPool, block_keys, key_root
from blockdiff.engine.kv_events import BlockStored, KVEvent
from blockdiff.engine.request import Request, State


class KVCacheManager:
    def __init__(self, full: BlockPool, sliding: BlockPool, past: int, scope: str = "client"):
        """scope: whose requests share cached blocks: "client" (requests of one client, or of one
        cache_salt), or "global" (every request, unless a cache_salt sets it apart)."""
        self.full, self.sliding, self.past = full, sliding, past
        self.scope = scope
        self.block_size = full.block_size
        self.queries = 0  # prompt tokens of first admissions...
        self.hits = 0  # ...and how many of them were found cached
        self.events: list[KVEvent] = []  # since the last take_events()
        full.events = self.events

    def _root(self, req: Request) -> bytes:
        if req.key_root is None:  # its client is known once it is added
            req.key_root = key_root(req.params.cache_salt, req.client, self.scope, None if req.adapter is None else req.adapter.key)
        return req.key_root

    def _hit(self, req: Request) -> tuple[int, list[int], list[int], list[bytes]]:
        """-> (blocks hit, their full blocks, their sliding table (-1 out of reach), their keys)."""
        if not self.full.caching:
            return 0, [], [], []
        if len(req.prefix_keys) != req.num_tokens // self.block_size:  # not every step the request waits
            req.prefix_keys = block_keys(req.key_tokens(0, req.num_tokens), self.block_size, self._root(req))
        keys = req.prefix_keys
        full = []
        for key in keys:
            block = self.full.lookup(key)
            if block is None:
                break
            full.append(block)
        for k in range(len(full), 0, -1):
            # an image is encoded whole (Request.chunk); a piece of the prompt to score needs its prefix only
            if req.splits_item(k * self.block_size) or k * self.block_size > req.max_hit:
                continue
            lo = max(0, k * self.block_size - self.past) // self.block_size
            sliding = [self.sliding.lookup(key) for key in keys[lo:k]]
            if None not in sliding:
                return k, full[:k], [-1] * lo + sliding, keys[:k]
        return 0, [], [], []

    def computing(self, req: Request, running: list[Request]) -> bool:
        """Whether a running request is prefilling the block that `req`'s cached prefix stops before
        (the choices of one prompt, prompts of one context): admitted once it is registered, `req`
        finds it cached instead of computing it again beside it."""
        k = self._hit(req)[0]
        if k >= len(req.prefix_keys) or (k + 1) * self.block_size > req.max_hit:
            return False
        key = req.prefix_keys[k]
        return any(key in r.prefix_keys[len(r.block_hashes):] for r in running if r.state == State.PREFILL)

    def _need(self, req: Request, end: int) -> tuple[int, int]:
        """New (full, sliding) blocks for `req` to hold positions up to `end`."""
        n = self.full.blocks_for(end)
        return n - len(req.blocks), n - len(req.sliding_blocks)

    def _admission(self, req: Request, budget: int) -> tuple | None:
        """What admitting `req` takes: (its hit, the tokens of its first chunk), or None if the
        pools cannot give it now (or no prefill budget is left for it)."""
        hit = self._hit(req)
        k, full, sliding, _ = hit
        cached = k * self.block_size
        n = min(req.num_tokens - cached, budget)
        if n <= 0 and cached < req.num_tokens:
            return None
        if n > 0:
            n = req.chunk(cached, n)
        new = self.full.blocks_for(cached + n) - k
        # Cached blocks nobody holds are counted as free: sharing them takes them out of the queue.
        if new + sum(1 for b in full if self.full.refs[b] == 0) > self.full.num_free:
            return None
        if new + sum(1 for b in sliding if b >= 0 and self.sliding.refs[b] == 0) > self.sliding.num_free:
            return None
        return hit, n

    def can_admit(self, req: Request, budget: int) -> bool:
        return self._admission(req, budget) is not None

    def admit(self, req: Request, budget: int) -> int | None:
        """Give a waiting request its cached prefix and the blocks of its first chunk (at most
        `budget` tokens); -> the tokens found cached, or None (and nothing held) if its first chunk
        does not fit now."""
        admission = self._admission(req, budget)
        if admission is None:
            return None
        (k, full, sliding, hashes), n = admission
        for b in full:
            self.full.share(b)
        for b in sliding:
            if b >= 0:
                self.sliding.share(b)
        req.blocks, req.sliding_blocks, req.block_hashes = full, sliding, hashes
        cached = k * self.block_size
        self.grow(req, cached + n)
        if req.metrics.preemptions == 0:  # as vLLM counts them: first admissions only
            req.num_cached_prompt_tokens = min(cached, len(req.prompt_token_ids))
            self.queries += len(req.prompt_token_ids)
            self.hits += req.num_cached_prompt_tokens
        return cached

    def grow(self, req: Request, end: int) -> bool:
        """Blocks for the positions of `req` up to `end`; False (and nothing taken) if the pools
        cannot give them now."""
        need_full, need_sliding = self._need(req, end)
        if need_full > self.full.num_free or need_sliding > self.sliding.num_free:
            return False
        req.blocks += self.full.allocate(max(0, need_full))
        req.sliding_blocks += self.sliding.allocate(max(0, need_sliding))
        return True

    def cached(self, req: Request) -> None:
        """`req.num_cached` advanced: register its newly full blocks and give back the sliding blocks
        out of its reach."""
        bs, done = self.block_size, req.num_cached
        if self.full.caching and len(req.block_hashes) < done // bs:
            first = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else self._root(req)
            stored = []
            for i, key in enumerate(block_keys(req.key_tokens(first * bs, done // bs * bs), bs, parent), first):
                if self.full.register(req.blocks[i], key):
                    stored.append(i)
                if req.sliding_blocks[i] >= 0:
                    self.sliding.register(req.sliding_blocks[i], key)
                req.block_hashes.append(key)
            self._stored(req, stored)
        i = max(0, done - self.past) // bs - 1  # the last block out of reach; those before went first
        while i >= 0 and req.sliding_blocks[i] >= 0:
            self.sliding.free([req.sliding_blocks[i]])
            req.sliding_blocks[i] = -1
            i -= 1

    def _stored(self, req: Request, blocks: list[int]) -> None:
        """Record the blocks `req` registered, one BlockStored per run of consecutive ones (a block
        whose key another block holds already is not registered, and breaks the run)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in blocks:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            extra = [tuple(dict.fromkeys(p.item.digest.hex() for p in req.placeholders
                                         if p.start < (i + 1) * bs and p.end > i * bs)) or None for i in run]
            self.events.append(BlockStored([req.block_hashes[i] for i in run],
                                           req.block_hashes[run[0] - 1] if run[0] else None,
                                           req.tokens(run[0] * bs, (run[-1] + 1) * bs), bs, extra))

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call."""
        if not self.events:
            return []
        out = list(self.events)
        self.events.clear()  # the pool holds this list
        return out

    def free(self, req: Request) -> None:
        self.full.free(req.blocks[::-1])
        self.sliding.free([b for b in req.sliding_blocks[::-1] if b >= 0])
        req.blocks, req.sliding_blocks = [], []

    def forget(self) -> None:
        """The workers' caches are new and empty: no block holds a cached prefix any more."""
        self.full.forget()
        self.sliding.forget()

    @property
    def usage(self) -> float:
        return self.full.used / max(1, self.full.num_blocks)
