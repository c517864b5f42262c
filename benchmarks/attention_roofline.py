"""Bytes and FLOPs of one attention call (one layer) of a step of canvases at DiffusionGemma-26B-A4B's
shapes, for the Triton kernel and the reference backend, and their predicted H200 times on the
roofline: max(bytes / 4.8 TB/s, FLOPs / 989 TFLOP/s). These are what the device check's `kernels`
part measures against (docs/kernels.md).

    python benchmarks/attention_roofline.py

Shapes: canvases of 256 rows, 16 query heads; sliding layers 8 KV heads of 256, window 1024 (a
canvas sees 1023 cached positions plus its canvas); full layers 2 KV heads of 512 (V is K's
projection, but cached apart). bfloat16 everywhere but the statistics.

The Triton kernel's bytes are the compulsory ones: Q and O once, each canvas's cached K and V once
per KV head (its query tiles and the query heads sharing a KV head re-read them from L2), its own K
and V once. The reference's are those of its ops as they run on CUDA (attention_backends/reference.py):
the gathered K/V copies (index_select, K's transpose made contiguous), the queries expanded per key
block and made contiguous, then per score element: the product written in bf16 (2 B), widened to
float32 (read 2, write 4), the mask added in place (8), the max (4), exp(x - m) in place (sub_ 8,
exp_ 8), the sum (4), narrowed to bf16 for the product with V (4 + 2) and read by it (2): 48 B; and
the per-key-block partial outputs (bf16 written, widened, summed: 2 + 6 + 4 B per element).
"""

from __future__ import annotations

BW, PEAK = 4.8e12, 989e12
CANVAS, HEADS, KEY_BLOCK, WINDOW = 256, 16, 256, 1024
KINDS = {"sliding": (8, 256), "full": (2, 512)}  # kind -> (KV heads, head dim)
LAYERS = {"sliding": 25, "full": 5}  # of 30 (5 sliding : 1 full)
BF16, F32 = 2, 4
SCORE_BYTES = 48  # per materialized float32 score element, as counted above


def cached_keys(kind: str, context: int) -> tuple[int, int]:
    """(keys the kernel reads, keys the reference reads in whole key blocks) per canvas."""
    if kind == "full":
        return context, -(-context // KEY_BLOCK) * KEY_BLOCK
    past = min(context, WINDOW - 1)
    blocks = min(-(-context // KEY_BLOCK), -(-(WINDOW - 1 + KEY_BLOCK - 1) // KEY_BLOCK))
    return past, blocks * KEY_BLOCK


def triton_cost(kind: str, batch: int, context: int) -> tuple[float, float]:
    kv, dim = KINDS[kind]
    keys, _ = cached_keys(kind, context)
    flops = 4 * batch * CANVAS * (keys + CANVAS) * dim * HEADS
    qo = 2 * batch * CANVAS * HEADS * dim * BF16
    kv_bytes = 2 * batch * (keys + CANVAS) * kv * dim * BF16
    return qo + kv_bytes, flops


def reference_cost(kind: str, batch: int, context: int) -> tuple[float, float]:
    kv, dim = KINDS[kind]
    _, keys = cached_keys(kind, context)
    blocks = keys // KEY_BLOCK
    flops = 4 * batch * CANVAS * (keys + CANVAS) * dim * HEADS
    qo = 2 * batch * CANVAS * HEADS * dim * BF16
    # gathered copies: K and V read and written, K's transpose read and written again
    gathers = 3 * 2 * batch * keys * kv * dim * BF16
    own = 2 * batch * CANVAS * kv * dim * BF16
    queries = 2 * batch * CANVAS * HEADS * dim * BF16 * blocks  # expanded per block, made contiguous
    scores = SCORE_BYTES * batch * HEADS * CANVAS * (keys + CANVAS)
    partials = (2 + 6 + 4) * batch * HEADS * CANVAS * dim * (blocks + 1)
    return qo + gathers + own + queries + scores + partials, flops


def predicted_ms(nbytes: float, flops: float) -> float:
    return 1e3 * max(nbytes / BW, flops / PEAK)


def main() -> None:
    print("| layer | canvases | context | Triton MB | Triton GFLOP | Triton ms | reference MB | reference ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        for context in (1024, 8192):
            for batch in (1, 8, 16):
                tb, tf = triton_cost(kind, batch, context)
                rb, rf = reference_cost(kind, batch, context)
                t, r = predicted_ms(tb, tf), predicted_ms(rb, rf)
                print(f"| {kind} | {batch} | {context} | {tb / 1e6:,.0f} | {tf / 1e9:,.0f} | {t:.3f} | "
                      f"{rb / 1e6:,.0f} | {r:.3f} | {r / t:.1f}x |")
    print()
    print("| per denoising step (30 layers) | canvases | context | Triton ms | reference ms |")
    print("|---|---|---|---|---|")
    for context in (1024, 8192):
        for batch in (1, 8, 16):
            t = sum(n * predicted_ms(*triton_cost(k, batch, context)) for k, n in LAYERS.items())
            r = sum(n * predicted_ms(*reference_cost(k, batch, context)) for k, n in LAYERS.items())
            print(f"| | {batch} | {context} | {t:.2f} | {r:.2f} |")


if __name__ == "__main__":
    main()
