"""Attention of canvases over a cached prefix on the CPU: blockdiff's paged attention in fixed key
blocks (the reference backend, model/attention_backends/reference.py, what the CPU runs) against
PyTorch's SDPA over the same keys gathered by position (what the eager path ran before), side by
side, alternating, at the 15.8M bench checkpoint's attention shapes
(docs/benchmarks.md, *Commands*): full layers one KV head of 128, sliding layers two of 64 (window 512), four query heads, canvas 64.

    OMP_NUM_THREADS=1 python benchmarks/attention.py [CANVASES ...]

Prints, per layer kind, canvases and prefix length, the median ms of each side, their ratio, and
the largest difference of the outputs.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from blockdiff.model.attention import CacheGeometry, Row, build_metadata

BLOCK, CANVAS, HEADS, REPS = 16, 64, 4, 7
KINDS = {False: (1, 128), True: (2, 64)}  # layer kind (sliding) -> (KV heads, head dim)
WINDOW = 512


def _sdpa_gathered(q, k, v, cache, rows, geo, sliding):
    """The code before: each canvas's cached keys gathered by position, its own keys before them,
    one SDPA call over [canvases, heads, CL, keys] (all canvases share a prefix length here)."""
    n = len(rows)
    kc, vc = cache
    past = min(rows[0].start, geo.window_past) if sliding else rows[0].start
    index = torch.stack([torch.tensor(r.blocks)[torch.arange(r.start - past, r.start) // BLOCK] * BLOCK
                         + torch.arange(r.start - past, r.start) % BLOCK for r in rows])
    keys = torch.cat((k.view(n, CANVAS, *k.shape[1:]), kc.transpose(0, 1)[index]), 1)
    values = torch.cat((v.view(n, CANVAS, *v.shape[1:]), vc.transpose(0, 1)[index]), 1)
    qs = q.view(n, CANVAS, *q.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(qs, keys.transpose(1, 2), values.transpose(1, 2), scale=1.0, enable_gqa=True)
    return out.transpose(1, 2).reshape(n * CANVAS, -1)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    canvases = [int(a) for a in sys.argv[1:]] or [1, 8]
    torch.manual_seed(0)
    geo = CacheGeometry(block_size=BLOCK, window_past=WINDOW - 1, window=WINDOW)
    print(f"{'kind':8} {'canvases':>8} {'prefix':>7} {'paged (ms)':>11} {'SDPA gathered (ms)':>19} {'ratio':>6} {'max diff':>9}")
    for sliding, (kv, dim) in KINDS.items():
        for n in canvases:
            for prefix in (1024, 4096, 16384):
                blocks_per_row = -(-prefix // BLOCK)
                entries = n * blocks_per_row * BLOCK
                cache = (torch.randn(kv, entries, dim), torch.randn(kv, entries, dim))
                # rows' blocks interleaved through the pool, as a busy cache hands them out
                rows = [Row(i, prefix, CANVAS, True, tuple(range(i, n * blocks_per_row, n))) for i in range(n)]
                q, k, v = torch.randn(n * CANVAS, HEADS, dim), torch.randn(n * CANVAS, kv, dim), torch.randn(n * CANVAS, kv, dim)
                with torch.inference_mode():
                    meta = build_metadata(rows, geo, {sliding}, "cpu").kind(sliding)
                    ours, theirs = lambda: meta.attend(q, k, v, cache), lambda: _sdpa_gathered(q, k, v, cache, rows, geo, sliding)  # noqa: E731
                    diff = (ours() - theirs()).abs().max().item()
                    a, b = [], []
                    for _ in range(REPS):
                        a.append(_time(ours))
                        b.append(_time(theirs))
                ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
                print(f"{'sliding' if sliding else 'full':8} {n:8d} {prefix:7d} {ma:11.2f} {mb:19.2f} {ma / mb:6.2f} {diff:9.1e}")


if __name__ == "__main__":
    main()
