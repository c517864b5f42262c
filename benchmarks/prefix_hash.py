"""What a prefix-cache block key costs: SHA-256 over the parent's key and the block's token ids
(engine/block_allocator.block_keys) beside the chained Python hash() of (parent, tokens) it replaced.

    .venv/bin/python benchmarks/prefix_hash.py

Keys every full block of a 32,768-token prompt (2,048 blocks of 16 tokens, and 128 of 256), as
the engine does once per request admitted and once per block committed. Median of 7 runs.
"""

from __future__ import annotations

import random
import statistics
import time

from blockdiff.engine.block_allocator import block_keys

TOKENS = 32768


def python_hash_keys(tokens: list[int], block_size: int) -> list[int]:
    """The keys before: hash((parent hash, tuple of the block's tokens)), chained."""
    out, parent = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[i : i + block_size])))
        out.append(parent)
    return out


def per_block_us(fn, tokens: list[int], block_size: int) -> float:
    runs = []
    for _ in range(7):
        t = time.perf_counter()
        fn(tokens, block_size)
        runs.append(time.perf_counter() - t)
    return statistics.median(runs) / (len(tokens) // block_size) * 1e6


def main() -> None:
    tokens = [random.Random(0).randrange(262144) for _ in range(TOKENS)]
    print(f"{'block size':>10} {'hash() us/block':>16} {'SHA-256 us/block':>17} {'ratio':>6}")
    for block_size in (16, 256):
        old, new = per_block_us(python_hash_keys, tokens, block_size), per_block_us(block_keys, tokens, block_size)
        print(f"{block_size:>10} {old:16.2f} {new:17.2f} {new / old:6.2f}")


if __name__ == "__main__":
    main()
