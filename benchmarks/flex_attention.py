"""Canvas attention on the CPU: SDPA with a key mask (what the reference attention backend runs for canvases) against FlexAttention
with a block mask, both under torch.compile(fullgraph=True), at the 15.8M bench checkpoint's shapes
(4 query heads over 2 KV heads of 64, canvases of 64 tokens) over a 256-position prefix of which
each canvas has a random part; 1 and 8 canvases; alternating, medians of 20 timings of 10 calls.

    OMP_NUM_THREADS=1 python benchmarks/flex_attention.py
"""
import time, torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
torch.manual_seed(0)
for B in (1, 8):
    CL, P, H, KV, D = 64, 256, 4, 2, 64
    q = torch.randn(B, H, CL, D); k = torch.randn(B, KV, CL + P, D); v = torch.randn(B, KV, CL + P, D)
    valid = torch.arange(P)[None] >= torch.randint(0, P, (B,))[:, None]  # a prefix of each length
    key_ok = torch.cat((torch.ones(B, CL, dtype=torch.bool), valid), 1)
    def sdpa(q, k, v, key_ok):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_ok[:, None, None, :], scale=1.0, enable_gqa=True)
    def mask_mod(b, h, qi, ki):
        return key_ok[b, ki]
    bm = create_block_mask(mask_mod, B, None, CL, CL + P, device="cpu", BLOCK_SIZE=64)
    def flex(q, k, v):
        return flex_attention(q, k, v, block_mask=bm, scale=1.0, enable_gqa=True)
    sdpa_c = torch.compile(sdpa, fullgraph=True); flex_c = torch.compile(flex, fullgraph=True)
    with torch.inference_mode():
        a = sdpa_c(q, k, v, key_ok); b = flex_c(q, k, v)
        print("max diff", (a - b).abs().max().item())
        ts = {"sdpa": [], "flex": []}
        for _ in range(20):
            for name, f in (("sdpa", lambda: sdpa_c(q, k, v, key_ok)), ("flex", lambda: flex_c(q, k, v))):
                t = time.perf_counter(); [f() for _ in range(10)]; ts[name].append((time.perf_counter() - t) / 10)
        s, fl = sorted(ts["sdpa"])[10] * 1e3, sorted(ts["flex"])[10] * 1e3
        print(f"B={B}: SDPA {s:.3f} ms, FlexAttention {fl:.3f} ms, SDPA/Flex {s / fl:.2f}")
