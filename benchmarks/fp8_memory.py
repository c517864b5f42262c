"""FP8 against bfloat16 on the CPU: resident weight bytes and the speed of a canvas forward.

Two models, each written as a bfloat16/float32 checkpoint, turned into FP8 by the real
`blockdiff quantize --fp8-dynamic` (run as a subprocess) and loaded twice by the real loader in
bfloat16 (`load_model(path, dtype=torch.bfloat16)`): once from the source, once from the FP8 copy.

(a) The 15.8M checkpoint of `blockdiff bench offline` (docs/benchmarks.md: hidden 256, 6 layers,
    16 experts top-4, vocabulary 8192, canvas 64), float32 on disk as there.
(b) Two layers (one sliding, one full) at the widths of DiffusionGemma-26B-A4B
    (/work/shared/DESIGN.md §9: hidden 2816, 16 heads, 8 sliding / 2 full KV heads, head dims
    256 / 512, dense MLP 2112, 128 experts top-8 of width 704, vocabulary 262,144, canvas 256),
    bfloat16 on disk, written one layer per file so that only one layer's random tensors exist at a
    time (all at once would take ~14 GB here); ~4.5 GiB on disk in bfloat16, ~3.0 GiB in FP8.

Printed per model: the storage bytes of every parameter and buffer by part (embedding = the tied LM
head, experts, the rest of the layers, everything else) for both loads and their ratio; the growth
of the process's anonymous resident memory (RssAnon) across each load; for (b) the bytes of the
full 30-layer model (25 sliding + 5 full layers) projected from its two layers; then the time of one
forward of a canvas (a denoising step's model part: self-conditioning off, a 128-token prompt in
the cache; for (b) the two layers only, without the bfloat16 LM head that both share), FP8 against
bfloat16, medians of --reps (--real-reps) runs in this one process. (a) holds both models
and alternates them, then does the same with both loaded in float32 (the dtype the CPU engine runs
in `bench offline`; FP8 weights are then dequantized to float32 per product); (b) holds one model
at a time (both would take ~8 GB), bfloat16 runs first.

    OMP_NUM_THREADS=1 python benchmarks/fp8_memory.py [--reps 5] [--real-reps 3] [--workdir DIR] [--skip-real-width]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from safetensors.torch import save_file

from blockdiff.model.interface import layer_kinds
from blockdiff.step import CacheConfig
from blockdiff.worker.cpu_heap import status_bytes
from blockdiff.worker.kv_cache import allocate, geometry
from blockdiff.model.attention import Row, build_metadata
from blockdiff.model.diffusion_gemma import DiffusionGemma
from blockdiff.model.loader import load_model
from blockdiff.model.tiny import TinySpec, config_dict, generation_config_dict, make_tiny_model, random_tensors

BENCH15 = TinySpec(
    vocab_size=8192, hidden_size=256, intermediate_size=512, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64,
    global_head_dim=128, num_global_kv_heads=1, num_experts=16, top_k_experts=4, moe_intermediate_size=128,
    sliding_window=512, canvas_length=64,
)
REAL_2_LAYERS = TinySpec(
    vocab_size=262_144, hidden_size=2816, intermediate_size=2112, num_layers=2, num_heads=16, num_kv_heads=8,
    head_dim=256, global_head_dim=512, num_global_kv_heads=2, num_experts=128, top_k_experts=8,
    moe_intermediate_size=704, sliding_window=1024, canvas_length=256, dtype="bfloat16", tokenizer=False,
)
REAL_LAYERS = {"sliding": 25, "full": 5}  # the released model's 30 layers, 5 sliding : 1 full
PROMPT = 128
PARTS = ("embedding (tied LM head)", "experts", "other layer weights", "rest")


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Storage bytes of every parameter and buffer of a loaded DiffusionGemma, by part of PARTS and
    per layer ("layers.N")."""
    out = dict.fromkeys(PARTS, 0)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        n = t.numel() * t.element_size()
        if name.startswith("embed."):
            part = PARTS[0]
        elif name.startswith("layers."):
            part = PARTS[1] if ".experts." in name else PARTS[2]
            layer = ".".join(name.split(".")[:2])
            out[layer] = out.get(layer, 0) + n
        else:
            part = PARTS[3]
        out[part] += n
    return out


def total_bytes(parts: dict[str, int]) -> int:
    return sum(parts[p] for p in PARTS)


def projected_bytes(model: DiffusionGemma, parts: dict[str, int]) -> int:
    """Bytes of the model with REAL_LAYERS layers, each the size of this model's layer of its kind."""
    per_kind = {}
    for i, spec in enumerate(model.config.arch.layers):
        per_kind.setdefault("sliding" if spec.sliding else "full", parts[f"layers.{i}"])
    layers = sum(parts[f"layers.{i}"] for i in range(model.config.num_layers))
    return total_bytes(parts) - layers + sum(n * per_kind[k] for k, n in REAL_LAYERS.items())


def measured_load(path: str, dtype: torch.dtype = torch.bfloat16) -> tuple[DiffusionGemma, int]:
    """-> (the model loaded in `dtype`, growth of RssAnon across the load)."""
    gc.collect()
    before = status_bytes("RssAnon")  # file pages of mapped checkpoints excluded
    model = load_model(path, dtype=dtype)
    gc.collect()
    return model, status_bytes("RssAnon") - before


def write_layerwise(out_dir: str, spec: TinySpec) -> str:
    """make_tiny_model's checkpoint of `spec` (random tensors, no tokenizer), one file per layer plus
    one for everything else: each file's tensors come from `random_tensors` of a one-layer spec."""
    os.makedirs(out_dir, exist_ok=True)
    for name, content in (("config.json", config_dict(spec)), ("generation_config.json", generation_config_dict(spec))):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)
    layer0 = ("model.decoder.layers.0.", "model.encoder.language_model.layers.0.")
    # Embedding, final norm, self-conditioning and vision tower at full size; its one layer is dropped.
    shell = dataclasses.replace(spec, num_layers=1, layer_types=["full_attention"], num_experts=1, top_k_experts=1)
    rest = {k: v for k, v in random_tensors(shell).items() if not k.startswith(layer0)}
    save_file(rest, os.path.join(out_dir, "rest.safetensors"), metadata={"format": "pt"})
    del rest
    for i, kind in enumerate(spec.resolved_layer_types()):
        one = dataclasses.replace(spec, num_layers=1, layer_types=[kind], vocab_size=16, seed=spec.seed + 1 + i)
        tensors = {
            p.replace(".0.", f".{i}.") + k[len(p) :]: v
            for k, v in random_tensors(one).items()
            for p in layer0
            if k.startswith(p)
        }
        save_file(tensors, os.path.join(out_dir, f"layer-{i:02d}.safetensors"), metadata={"format": "pt"})
        del tensors
    return out_dir


def quantized(src: str, dst: str) -> str:
    subprocess.run([sys.executable, "-m", "blockdiff", "quantize", "--fp8-dynamic", src, dst], check=True, stdout=subprocess.DEVNULL)
    return dst


def canvas_forward(model: DiffusionGemma, layers_only: bool = False, seed: int = 0) -> Callable[[], torch.Tensor]:
    """A 128-token prompt put in a fresh cache; -> a function running one forward of a canvas after
    it (the model part of a first denoising step), returning its logits, or with `layers_only` the
    last layer's hidden states (no final norm, no LM head)."""
    canvas = model.config.canvas_length
    cfg = CacheConfig(num_slots=1, num_blocks=-(-(PROMPT + canvas) // 16), block_size=16, max_model_len=PROMPT + canvas)
    kv, geo, blocks = allocate(model, cfg, "cpu"), geometry(model, cfg), tuple(range(cfg.num_blocks))
    g = torch.Generator().manual_seed(seed)

    def ids(meta, n: int) -> torch.Tensor:
        out = torch.zeros(meta.num_tokens, dtype=torch.long)
        out[:n] = torch.randint(0, model.config.vocab_size, (n,), generator=g)
        return out

    with torch.no_grad():
        meta = build_metadata([Row(0, 0, PROMPT, False, blocks)], geo, layer_kinds(model), "cpu")
        model(ids(meta, PROMPT), meta, kv)
    meta = build_metadata([Row(0, PROMPT, canvas, True, blocks)], geo, layer_kinds(model), "cpu")
    canvas_ids = ids(meta, canvas)

    @torch.no_grad()
    def step() -> torch.Tensor:
        return (model.backbone if layers_only else model)(canvas_ids, meta, kv)

    return step


def timed(fn: Callable, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def gib(n: int) -> str:
    return f"{n / 2**30:8.3f} GiB" if n >= 2**28 else f"{n / 2**20:8.2f} MiB"


def report_bytes(bf16: dict[str, int], fp8: dict[str, int]) -> None:
    print(f"    {'resident weight bytes':28} {'bfloat16':>12} {'FP8':>12}  ratio")
    for part in PARTS:
        ratio = f"{fp8[part] / bf16[part]:.3f}" if bf16[part] else "-"
        print(f"    {part:28} {gib(bf16[part])} {gib(fp8[part])}  {ratio}")
    a, b = total_bytes(bf16), total_bytes(fp8)
    print(f"    {'total':28} {gib(a)} {gib(b)}  {b / a:.3f}")


def report_rss(bf16: int, fp8: int) -> None:
    print(f"    {'RssAnon growth over the load':28} {gib(bf16)} {gib(fp8)}  {fp8 / bf16:.3f}")


def report_speed(full: list[float], fp8: list[float], note: str, name: str = "bfloat16") -> None:
    a, b = statistics.median(full), statistics.median(fp8)
    print(
        f"    canvas forward ({note}): {name} {a * 1e3:.1f} ms, FP8 {b * 1e3:.1f} ms, FP8/{name} {b / a:.2f}x "
        f"(runs: {name} {', '.join(f'{t * 1e3:.0f}' for t in full)}; FP8 {', '.join(f'{t * 1e3:.0f}' for t in fp8)} ms)"
    )


def bench15(workdir: str, reps: int) -> None:
    src = make_tiny_model(os.path.join(workdir, "bench15"), BENCH15)
    fp8_path = quantized(src, os.path.join(workdir, "bench15-fp8"))
    (full, full_rss), (q, q_rss) = measured_load(src), measured_load(fp8_path)
    params = sum(p.numel() for p in full.parameters())
    print(f"(a) the 15.8M benchmark checkpoint ({params / 1e6:.1f}M parameters), canvas {BENCH15.canvas_length}")
    report_bytes(weight_bytes(full), weight_bytes(q))
    report_rss(full_rss, q_rss)
    report_speed(*alternating(full, q, reps), f"alternating, {reps} runs each")
    # The CPU engine runs float32 (bench offline): FP8 weights dequantized to float32 against float32.
    del full, q
    full, q = load_model(src, dtype=torch.float32), load_model(fp8_path, dtype=torch.float32)
    report_speed(*alternating(full, q, reps), f"float32 activations, alternating, {reps} runs each", "float32")


def alternating(full: DiffusionGemma, q: DiffusionGemma, reps: int) -> tuple[list[float], list[float]]:
    """Canvas forwards of both models in alternating order after a warm-up; -> (full's times, q's)."""
    steps = {"full": canvas_forward(full), "fp8": canvas_forward(q)}
    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {"full": [], "fp8": []}
    for i in range(reps):
        for side in ("full", "fp8") if i % 2 == 0 else ("fp8", "full"):
            times[side] += timed(steps[side], 1)
    return times["full"], times["fp8"]


def real_width(workdir: str, real_reps: int) -> None:
    t0 = time.perf_counter()
    src = write_layerwise(os.path.join(workdir, "real2"), REAL_2_LAYERS)
    t1 = time.perf_counter()
    fp8_path = quantized(src, os.path.join(workdir, "real2-fp8"))
    print(f"(b) two layers at the 26B-A4B widths, canvas {REAL_2_LAYERS.canvas_length} "
          f"(bf16 checkpoint written in {t1 - t0:.0f} s, quantized in {time.perf_counter() - t1:.0f} s)")
    results = {}
    for side, path in (("bf16", src), ("fp8", fp8_path)):
        model, rss = measured_load(path)
        # The prompt's forward is the warm-up. The LM head (262,144 x 2816, bfloat16 in both, ~380
        # GFLOP per canvas) would dominate two layers' time, so only the layers are timed.
        step = canvas_forward(model, layers_only=True)
        results[side] = (weight_bytes(model), rss, projected_bytes(model, weight_bytes(model)), timed(step, real_reps))
        del model, step
    (bf16, bf16_rss, bf16_30, bf16_t), (fp8, fp8_rss, fp8_30, fp8_t) = results["bf16"], results["fp8"]
    report_bytes(bf16, fp8)
    report_rss(bf16_rss, fp8_rss)
    for kind, i in (("sliding", 0), ("full", 1)):
        print(f"    {f'one {kind} layer':28} {gib(bf16[f'layers.{i}'])} {gib(fp8[f'layers.{i}'])}  {fp8[f'layers.{i}'] / bf16[f'layers.{i}']:.3f}")
    print(f"    {'projected to 30 layers':28} {gib(bf16_30)} {gib(fp8_30)}  {fp8_30 / bf16_30:.3f}")
    report_speed(bf16_t, fp8_t, f"the two layers only, one model at a time, bfloat16 first, {real_reps} runs each")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="timed canvas forwards per side, (a)")
    p.add_argument("--real-reps", type=int, default=3, help="timed canvas forwards per side, (b)")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory, removed after)")
    p.add_argument("--skip-real-width", action="store_true", help="only (a)")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; weights loaded as bfloat16, FP8 weights stay FP8")
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        bench15(workdir, args.reps)
        if not args.skip_real_width:
            real_width(workdir, args.real_reps)


if __name__ == "__main__":
    main()
