"""The device check (scripts/device_check.sh runs this): the oracle tests on the device, the compiled
step's graph-replay test, and DiffusionGemma-26B-A4B with dummy weights timed against the
HBM-bandwidth roofline and against transformers' generate on the same model.

Parts, each recorded in <out>/device_check.json and summed up in <out>/device_check.txt:

1. tests: tests/test_parity.py and tests/test_generation.py's parity tests (float32 and bfloat16)
   with BLOCKDIFF_TEST_DEVICE=<device>, and tests/test_canvas_step.py's CUDA-graph replay test
   (the compiled static step captured per shape, against eager). --small only collects them with that setting (the default suite runs them on the CPU).
2. blockdiff: the model from configs/diffusiongemma-26b-a4b.json (--small: one 5:1 group of six
   layers of the same structure at tiny widths, 2 steps, batches 1 and 2) with dummy weights in
   bfloat16. Per batch: one canvas and two canvases of --steps (16) denoising steps each (no early
   stop); their difference is one canvas's time, the ITL per canvas, and / steps the time per
   denoising step (the commit of the canvas included).
3. roofline: the bytes one denoising step must read at that batch (weights, KV cache, logits:
   blockdiff/bench/roofline.py) over the device's copy bandwidth (measured) and its nominal HBM
   bandwidth (--hbm-gbs), against the measured step.
4. transformers: `generate` on the same config with its own random weights, bfloat16, batch 1, the
   same canvas and steps, timed the same way; the ratio to blockdiff at batch 1.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from blockdiff import LLM, SamplingParams  # noqa: E402
from blockdiff.bench.roofline import measure_peak, plan_cost  # noqa: E402
from blockdiff.config import ModelConfig  # noqa: E402
from blockdiff.model.registry import load_config, parse_config  # noqa: E402
from blockdiff.demo import demo_checkpoint  # noqa: E402
from blockdiff.diffusion.entropy_bound import EntropyBound, denoise_params  # noqa: E402
from blockdiff.model.attention import Row  # noqa: E402
from blockdiff.sampling_params import REFERENCE_DEFAULTS  # noqa: E402
from blockdiff.step import StepPlan  # noqa: E402

BIG = os.path.join(ROOT, "configs", "diffusiongemma-26b-a4b.json")
STEPS = 16  # per canvas, as vLLM's published figure
# Tiny widths of the same structure: 5 sliding : 1 full, GQA, two head dims, MoE, tied embedding.
SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_experts=8, top_k_experts=2, moe_intermediate_size=32, sliding_window=32)
SMALL_FULL_LAYER = {"head_dim": 32, "num_key_value_heads": 1}
SMALL_CANVAS, SMALL_LAYERS, SMALL_STEPS, SMALL_BATCHES = 16, 6, 2, "1,2"
TESTS = "parity or reference"


def model_config(small: bool) -> dict:
    with open(BIG) as f:
        raw = json.load(f)
    if small:
        text = raw["text_config"]
        text.update(SMALL)
        text["num_hidden_layers"] = SMALL_LAYERS
        text["layer_types"] = text["layer_types"][:SMALL_LAYERS]
        text["per_layer_config"] = {k: dict(SMALL_FULL_LAYER) for k in text["per_layer_config"] if int(k) < SMALL_LAYERS}
        raw["canvas_length"] = SMALL_CANVAS
    return raw


def run_tests(device: str, small: bool) -> dict:
    env = {**os.environ, "BLOCKDIFF_TEST_DEVICE": device, "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    collect = ["--collect-only"] if small else []
    selections = {"parity and generation": [*collect, "tests/test_parity.py", "tests/test_generation.py", "-k", TESTS]}
    selections["compiled step, graph replay"] = [*collect, "tests/test_canvas_step.py", "-k", "cuda_graph"]
    out = {}
    for name, args in selections.items():
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        out[name] = {"passed": proc.returncode == 0, "collected_only": small, "summary": lines[-1] if lines else "",
                     "seconds": time.perf_counter() - t0}
        if proc.returncode != 0:
            out[name]["tail"] = lines[-40:]
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[2] + torch.randint(3, vocab, (length - 1,), generator=g).tolist() for _ in range(batch)]


def _params(canvases: int, canvas: int, steps: int) -> SamplingParams:
    # No early stop (a confidence no canvas reaches): every canvas takes all its steps.
    return SamplingParams(max_tokens=canvases * canvas, max_denoising_steps=steps, confidence_threshold=1e-30,
                          ignore_eos=True, seed=0)


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def time_blockdiff(config_path: str, device: str, batches: list[int], prompt_len: int, layers: int | None, steps: int) -> dict:
    config = load_config(config_path)
    canvas = config.canvas_length
    out = {}
    with LLM(config_path, load_format="dummy", dtype="bfloat16", device=device, tokenizer=demo_checkpoint(),
             max_num_seqs=max(batches), max_model_len=prompt_len + 3 * canvas, num_layers_override=layers) as llm:
        for batch in batches:
            prompts = _prompts(batch, prompt_len, config.vocab_size)
            llm.generate(prompts, _params(1, canvas, steps), use_tqdm=False)  # warm-up: kernels, allocator, caches
            one = _timed(lambda: llm.generate(prompts, _params(1, canvas, steps), use_tqdm=False), device)
            two = _timed(lambda: llm.generate(prompts, _params(2, canvas, steps), use_tqdm=False), device)
            itl = two - one
            out[batch] = {"one_canvas_s": one, "two_canvases_s": two, "itl_per_canvas_ms": 1e3 * itl,
                          "ms_per_step": 1e3 * itl / steps}
        peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    return {"batches": out, "peak_memory_bytes": peak}


def roofline(config: ModelConfig, batch: int, prompt_len: int, steps: int, peak, hbm_gbs: float | None) -> dict:
    """Bytes one denoising step of `batch` canvases (halfway through the second canvas) must move,
    and the time they take at the measured copy bandwidth (`peak`) and the nominal one."""
    cl = config.canvas_length
    rows = [Row(i, prompt_len + cl, cl, True) for i in range(batch)]
    params = EntropyBound().resolve(SamplingParams(), REFERENCE_DEFAULTS)
    plan = StepPlan(rows, torch.zeros(0, dtype=torch.long), [], torch.zeros(0, cl, dtype=torch.long),
                    denoise_params([steps // 2] * batch, [params] * batch, torch.zeros(batch, cl),
                                   torch.zeros(batch, cl, dtype=torch.long)))
    cost = plan_cost(config, plan, dtype_bytes=2)
    out = {"bytes_per_step": cost.bytes, "measured_copy_gbs": peak.bandwidth_gbs,
           "bound_ms_measured_bandwidth": 1e3 * cost.bytes / (peak.bandwidth_gbs * 1e9)}
    if hbm_gbs:
        out["nominal_gbs"] = hbm_gbs
        out["bound_ms_nominal"] = 1e3 * cost.bytes / (hbm_gbs * 1e9)
    return out


def time_transformers(raw: dict, device: str, prompt_len: int, layers: int | None, steps: int) -> dict:
    import transformers
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    raw = copy.deepcopy(raw)
    if layers is not None:
        text = raw["text_config"]
        text["num_hidden_layers"] = layers
        text["layer_types"] = text["layer_types"][:layers]
        text["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items() if int(k) < layers}
    hf_config = DiffusionGemmaConfig.from_dict(raw)
    with torch.device(device):
        hf = DiffusionGemmaForBlockDiffusion._from_config(hf_config, dtype=torch.bfloat16).eval()
    cl = raw["canvas_length"]
    ids = torch.tensor(_prompts(1, prompt_len, raw["text_config"]["vocab_size"]), device=device)

    def generate(canvases: int):
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=canvases * cl, max_denoising_steps=steps, confidence_threshold=1e-30)

    generate(1)
    one = _timed(lambda: generate(1), device)
    two = _timed(lambda: generate(2), device)
    return {"version": transformers.__version__, "one_canvas_s": one, "two_canvases_s": two,
            "itl_per_canvas_ms": 1e3 * (two - one), "ms_per_step": 1e3 * (two - one) / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny widths of the same structure (CI runs this on the CPU)")
    p.add_argument("--out", default=os.path.join(ROOT, "device_check_out"))
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8,16; --small: 1,2)")
    p.add_argument("--steps", type=int, default=None, help=f"denoising steps per canvas (default {STEPS}; --small: {SMALL_STEPS})")
    p.add_argument("--layers", type=int, default=None, help="--num-layers-override for the timed models")
    p.add_argument("--hbm-gbs", type=float, default=None, help="nominal memory bandwidth, GB/s (H200: 4800)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: tests, blockdiff, transformers")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    batches = [int(b) for b in (args.batches or (SMALL_BATCHES if args.small else "1,8,16")).split(",")]
    steps = args.steps or (SMALL_STEPS if args.small else STEPS)
    prompt_len = 16 if args.small else 128
    os.makedirs(args.out, exist_ok=True)
    raw = model_config(args.small)
    config_path = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(config_path, "w") as f:
        json.dump(raw, f)
    config = parse_config(raw)
    if args.layers is not None:
        config = config.first_layers(args.layers)

    report = {"device": args.device, "small": args.small, "torch": torch.__version__, "python": platform.python_version(),
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "layers": config.num_layers, "canvas": config.canvas_length, "steps": steps, "prompt_tokens": prompt_len}
    started = time.perf_counter()
    if "tests" not in skip:
        report["tests"] = run_tests(args.device, args.small)
    if "blockdiff" not in skip:
        report["blockdiff"] = time_blockdiff(config_path, args.device, batches, prompt_len, args.layers, steps)
        peak = measure_peak(args.device, torch.bfloat16)
        report["roofline"] = {b: roofline(config, b, prompt_len, steps, peak, args.hbm_gbs) for b in batches}
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "transformers" not in skip:
        report["transformers"] = time_transformers(raw, args.device, prompt_len, args.layers, steps)
    report["seconds"] = time.perf_counter() - started

    with open(os.path.join(args.out, "device_check.json"), "w") as f:
        json.dump(report, f, indent=2)
    text = summary(report)
    with open(os.path.join(args.out, "device_check.txt"), "w") as f:
        f.write(text)
    print(text, end="")
    failed = [name for name, r in report.get("tests", {}).items() if r["passed"] is False]
    if failed:
        sys.exit(f"error: failed tests: {', '.join(failed)}")


def summary(r: dict) -> str:
    lines = [f"device check on {r['gpu'] or r['device']}: torch {r['torch']}, {r['layers']} layers, canvas {r['canvas']}, "
             f"{r['steps']} steps, prompt {r['prompt_tokens']} tokens{' (small shapes)' if r['small'] else ''}"]
    for name, t in r.get("tests", {}).items():
        state = {True: "collected" if t.get("collected_only") else "passed", False: "FAILED", None: "not run"}[t["passed"]]
        lines.append(f"  tests, {name}: {state} ({t['summary']})")
    if "blockdiff" in r:
        for batch, b in r["blockdiff"]["batches"].items():
            roof = r["roofline"][batch]
            bound = roof.get("bound_ms_nominal", roof["bound_ms_measured_bandwidth"])
            lines.append(f"  blockdiff batch {batch}: {b['ms_per_step']:.2f} ms/step, ITL {b['itl_per_canvas_ms']:.1f} ms per "
                         f"canvas; roofline {roof['bytes_per_step'] / 1e9:.2f} GB/step -> {bound:.2f} ms "
                         f"({100 * bound / b['ms_per_step']:.0f}% of roofline; measured copy bandwidth "
                         f"{roof['measured_copy_gbs']:.0f} GB/s)")
        if r["blockdiff"]["peak_memory_bytes"]:
            lines.append(f"  blockdiff peak device memory: {r['blockdiff']['peak_memory_bytes'] / 2**30:.1f} GiB")
    if "transformers" in r:
        t = r["transformers"]
        line = f"  transformers {t['version']} generate, batch 1: {t['ms_per_step']:.2f} ms/step, ITL {t['itl_per_canvas_ms']:.1f} ms"
        if "blockdiff" in r and 1 in r["blockdiff"]["batches"]:
            line += f"; blockdiff is {t['itl_per_canvas_ms'] / r['blockdiff']['batches'][1]['itl_per_canvas_ms']:.2f}x faster"
        lines.append(line)
    lines.append(f"  ({r['seconds']:.0f} s)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
