"""Accounting of full-attention KV cache blocks: which are free, who holds which."""

from __future__ import annotations


class BlockAllocator:
    """Free-list of blocks. A request reserves everything it can ever commit when it is admitted,
    so a running request never waits for memory."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self._held = [False] * num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self.free)

    def allocate(self, tokens: int) -> tuple[int, ...]:
        n = self.blocks_for(tokens)
        if n > len(self.free):
            raise RuntimeError(f"KV cache exhausted: {n} blocks asked, {len(self.free)} free")
        blocks = tuple(self.free.pop() for _ in range(n))
        for b in blocks:
            self._held[b] = True
        return blocks

    def release(self, blocks: tuple[int, ...]) -> None:
        for b in blocks:
            if not self._held[b]:
                raise RuntimeError(f"block {b} released twice")
            self._held[b] = False
        self.free.extend(reversed(blocks))

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)
