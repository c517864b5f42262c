"""The device check (scripts/device_check.sh runs this): what one lent GPU can tell in a few minutes,
written to <out>/device_check.json after every part and every batch, so a time-out or a crash
still returns everything measured before it (docs/device_check.md).

Parts, most valuable first; each runs in its own process (killed with its children at its time-out)
and records its own results; a part that fails records the tail of its traceback and the next one runs:

1. env: versions, the GPU and its compute capability, which experts kernel and step modes
   blockdiff/ops/kernels.py picks for the 26B-A4B shapes, which SDPA backends take its attention shapes.
2. headline: DiffusionGemma-26B-A4B (configs/diffusiongemma-26b-a4b.json), dummy bfloat16 weights,
   CUDA graphs without compile, batches 1, 8 and 16, each warmed up over both canvases' shapes
   before it is timed: ms per denoising step and per 256-token canvas at 16 steps (two canvases
   minus one: a canvas's 16 steps and its commit), against the larger of the bytes bound and the
   FLOP bound of the step (blockdiff/bench/roofline.py).
3. fp8: the same model with FP8-dynamic dummy weights, batches 1 and 16 (second: the figure users
   serve the model at, so it must not wait behind the tests).
4. kernels: each Triton kernel against the reference at the 26B-A4B shapes (docs/kernels.md has the
   predictions): one attention layer of each kind at 1, 8 and 16 canvases and contexts 1k and 8k,
   and one sampler step (statistics, argmax and draw, self-conditioning product) at 1, 8 and 16
   canvases: ms each, the bytes and FLOPs it must move, and the fraction of the roofline, recorded
   after every shape (--small: tiny shapes, the Triton kernels under Triton's interpreter).
5. steps_per_launch: the same model at batches 1 and 16, one denoising step per launch against
   the CPU's chosen number (blockdiff/config.py STEPS_PER_LAUNCH, or --steps-per-launch), their
   runs alternating in one engine: ms per denoising step each, and the ratio; and one
   step per launch without async scheduling, against it with.
6. transformers: `generate` on the same config, batch 1, timed the same way, for the ratio.
7. tests: the parity and generation tests against transformers, the CUDA-graph replay test and the
   FP8 experts test, with BLOCKDIFF_TEST_DEVICE=<device> (--small: collected only; the default
   suite runs them on the CPU).
8. compiled: 6 layers, compiled steps against uncompiled ones: compile seconds and what it buys
   (--small: one layer and the eager backend; the default suite tests compiled steps).
9. fake_cuda: tests/ops/test_fake_cuda.py and tests/ops/test_kernels.py, the CUDA path on fake CUDA tensors
   (--small: collected only; the default suite runs them).

--budget-s (default 480) bounds the whole run: a part whose estimate does not fit what is left is
skipped and says so; --timeout-s caps any one part. --fail-part NAME makes part NAME raise before
it starts, --hang-part NAME makes it hang after its first result (to see that the others' results,
and its own so far, stay). --parts / --skip choose parts (a rerun of what failed). --small: tiny
widths of the same structure, for the CPU (CI runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = os.path.join(ROOT, "configs", "diffusiongemma-26b-a4b.json")
PARTS = ("env", "headline", "fp8", "kernels", "steps_per_launch", "transformers", "tests", "compiled", "fake_cuda")
# Seconds each part is expected to take (device, --small); a part is skipped when its estimate
# exceeds the budget left, and killed when it runs past twice its estimate, the budget left or --timeout-s.
# The --small ones allow for a CPU shared with other jobs (the whole run takes ~1 min on a quiet one).
ESTIMATES = {"env": (15, 20), "headline": (150, 40), "steps_per_launch": (150, 40), "transformers": (120, 40), "tests": (150, 45),
             "fp8": (100, 40), "kernels": (90, 60), "compiled": (200, 60), "fake_cuda": (60, 60)}
KERNEL_CONTEXTS, SMALL_KERNEL_CONTEXTS = (1024, 8192), (40, 80)
KERNEL_REPS = 5  # timed calls per shape after one warm-up; the best is kept
STEPS = 16  # per canvas, as vLLM's published figure
COMPILED_LAYERS = 6
SMALL_COMPILED_LAYERS = 1  # --small checks the part, not compiling: each layer adds seconds of tracing per shape
# Tiny widths of the same structure: 5 sliding : 1 full, GQA, two head dims, MoE, tied embedding.
SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_experts=8, top_k_experts=2, moe_intermediate_size=32, sliding_window=32)
SMALL_FULL_LAYER = {"head_dim": 32, "num_key_value_heads": 1}
SMALL_CANVAS, SMALL_LAYERS, SMALL_STEPS, SMALL_BATCHES = 16, 6, 2, "1,2"
TEST_SELECTIONS = {
    "parity and generation": ["tests/model/test_parity.py", "tests/model/test_generation.py", "-k", "parity or reference"],
    # Not the compiled variant: inductor compiles every captured shape, minutes of the budget.
    "CUDA-graph replay": ["tests/worker/test_canvas_step.py", "-k", "cuda_graph and not compiled"],
    "FP8 experts": ["tests/ops/test_fp8_experts.py"],
    # The Triton attention kernel compiled for the device, against the reference, on the cases of one launch.
    "Triton attention": ["tests/ops/test_triton_attention.py", "-k", "mixed_step or v_equal"],
}


# ---- the report: one JSON file, rewritten whole (atomically) after every change ------------------

class Report:
    def __init__(self, out: str):
        self.path = os.path.join(out, "device_check.json")

    def load(self) -> dict:
        with open(self.path) as f:
            return json.load(f)

    def save(self, data: dict) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, self.path)

    def part(self, data: dict, name: str) -> dict:
        return next(p for p in data["parts"] if p["name"] == name)

    def record(self, name: str, key: str, value) -> None:
        """part `name`'s result[key] = value, written now."""
        data = self.load()
        self.part(data, name).setdefault("result", {})[key] = value
        self.save(data)


def say(*parts) -> None:
    print(*parts, flush=True)


# ---- the parent: runs the parts in order, within the budget ------------------------------------

def run_all(args, passthrough: list[str]) -> int:
    os.makedirs(args.out, exist_ok=True)
    report = Report(args.out)
    started = time.monotonic()
    wanted = [p for p in PARTS if p in (args.parts or PARTS) and p not in args.skip]
    data = {"device": args.device, "small": args.small, "budget_s": args.budget_s, "parts_planned": wanted,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "seconds": 0.0,
            "parts": []}
    report.save(data)
    say(f"device check: {', '.join(wanted)} on {args.device}{' (small shapes)' if args.small else ''}, "
        f"budget {args.budget_s:.0f} s, writing {report.path}")
    failed = False
    for name in wanted:
        left = args.budget_s - (time.monotonic() - started)
        estimate = ESTIMATES[name][1 if args.small else 0]
        data = report.load()
        if estimate > left:
            data["parts"].append({"name": name, "status": "skipped", "seconds": 0.0,
                                  "reason": f"needs about {estimate} s, {max(0, left):.0f} s of the budget left"})
            say(f"[{name}] skipped: needs about {estimate} s, {max(0, left):.0f} s left")
        else:
            data["parts"].append({"name": name, "status": "running", "seconds": 0.0, "result": {}})
            report.save(data)
            timeout = min(2 * estimate, left, args.timeout_s or left)
            say(f"[{name}] running (time-out {timeout:.0f} s, {left:.0f} s of the budget left)")
            t0 = time.monotonic()
            code, timed_out, stderr_tail = _child(name, args, passthrough, timeout, t0 + timeout)
            data = report.load()
            part = report.part(data, name)
            part["seconds"] = round(time.monotonic() - t0, 1)
            if code == 0:
                part["status"] = "ok"
            else:
                failed = True
                part["status"] = "failed"
                part["error"] = f"timed out after {timeout:.0f} s" if timed_out else f"exit status {code}"
                part.setdefault("traceback", stderr_tail)
            say(f"[{name}] {part['status']} in {part['seconds']:.0f} s" + (f": {part['error']}" if code else ""))
        data["seconds"] = round(time.monotonic() - started, 1)
        report.save(data)
        _write_summary(args.out, data)
    print(summary(report.load()), end="", flush=True)
    return 1 if failed else 0


def _child(name: str, args, passthrough: list[str], timeout: float, deadline: float) -> tuple[int, bool, list[str]]:
    """Part `name` in a process of its own session, so that its time-out kills its children too."""
    cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--part", name, "--deadline", str(time.time() + timeout)]
    err_path = os.path.join(args.out, f".{name}.stderr")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=err, start_new_session=True)
        try:
            code, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, timed_out = proc.wait(), True
    with open(err_path, errors="replace") as f:
        tail = f.read().strip().splitlines()[-40:]
    os.remove(err_path)
    return code, timed_out, tail


def _write_summary(out: str, data: dict) -> None:
    with open(os.path.join(out, "device_check.txt"), "w") as f:
        f.write(summary(data))


def summary(data: dict) -> str:
    lines = [f"device check on {data['device']}{' (small shapes)' if data['small'] else ''}: {data['seconds']:.0f} s "
             f"of a {data['budget_s']:.0f} s budget"]
    for p in data["parts"]:
        head = f"  {p['name']}: {p['status']} ({p['seconds']:.0f} s)"
        r = p.get("result", {})
        if p["status"] == "skipped":
            head += f": {p['reason']}"
        elif p["status"] == "failed":
            head += f": {p.get('error')}; {(p.get('traceback') or [''])[-1]}"
        lines.append(head)
        if p["name"] == "env" and "gpu" in r:  # each key as far as the part got before it failed
            versions, kernels = r.get("versions", {}), r.get("kernels")
            line = f"    {r['gpu']}, torch {versions.get('torch')}"
            if kernels:
                line += ", experts: " + ", ".join(f"{kernels[k]['experts']} ({k})" for k in ("bfloat16", "fp8", "float32"))
            lines.append(line)
        for b, m in r.get("batches", {}).items():
            lines.append(f"    batch {b}: {m['ms_per_step']:.2f} ms/step, {m['ms_per_canvas']:.1f} ms per canvas; bound "
                         f"{m['bound_ms']:.2f} ms ({m['bound_limit']}), {100 * m['fraction_of_bound']:.0f}% of it")
        if "ms_per_step" in r:
            lines.append(f"    {r['ms_per_step']:.2f} ms/step, {r['ms_per_canvas']:.1f} ms per canvas")
        spl = r.get("steps_per_launch", {})
        for b, m in spl.get("batches", {}).items():
            lines.append(f"    batch {b}: K=1 {m['k1_ms_per_step']:.2f} ms/step, K={spl['k']} "
                         f"{m['k' + str(spl['k']) + '_ms_per_step']:.2f} ({m['speedup']:.2f}x); K=1 without async "
                         f"scheduling {m['k1_sync_ms_per_step']:.2f} ({m['async_speedup']:.2f}x)")
        for shape, m in r.get("attention", {}).items():
            lines.append(f"    attention {shape}: Triton {m['triton_ms']:.3f} ms ({100 * m['triton_fraction']:.0f}% of its "
                         f"bound {m['bound_ms']:.3f} ms), reference {m['reference_ms']:.3f} ms ({m['speedup']:.1f}x)")
        for shape, m in r.get("sampler", {}).items():
            lines.append(f"    sampler {shape}: Triton {m['triton_ms']:.3f} ms ({100 * m['triton_fraction']:.0f}% of its "
                         f"bound {m['bound_ms']:.3f} ms), reference {m['reference_ms']:.3f} ms ({m['speedup']:.1f}x)")
        for sel, t in r.get("selections", {}).items():
            lines.append(f"    {sel}: {t['summary']}")
        if "compile_s" in r:
            lines.append(f"    compile ({r['backend']}) {r['compile_s']:.0f} s; {r['compiled_ms_per_step']:.2f} against "
                         f"{r['eager_ms_per_step']:.2f} ms/step uncompiled ({r['speedup']:.2f}x)")
    return "\n".join(lines) + "\n"


# ---- the child: one part ------------------------------------------------------------------------

def run_part(args) -> int:
    report = Report(args.out)

    def record(key: str, value) -> None:
        report.record(args.part, key, value)
        if args.hang_part == args.part:
            say(f"  hanging after recording {key!r} (--hang-part)")
            time.sleep(24 * 3600)

    try:
        if args.fail_part == args.part:
            raise RuntimeError(f"failure injected into part {args.part!r} (--fail-part)")
        result = globals()[f"part_{args.part}"](args, record)
        data = report.load()
        report.part(data, args.part).setdefault("result", {}).update(result or {})
        report.save(data)
        return 0
    except BaseException:  # noqa: BLE001 - recorded, and the parent runs the next part
        tail = traceback.format_exc().strip().splitlines()[-40:]
        sys.stderr.write("\n".join(tail) + "\n")
        data = report.load()
        report.part(data, args.part)["traceback"] = tail
        report.save(data)
        return 1


def _config_raw(args, fp8: bool = False) -> dict:
    with open(BIG) as f:
        raw = json.load(f)
    if args.small:
        text = raw["text_config"]
        text.update(SMALL)
        text["num_hidden_layers"] = SMALL_LAYERS
        text["layer_types"] = text["layer_types"][:SMALL_LAYERS]
        text["per_layer_config"] = {k: dict(SMALL_FULL_LAYER) for k in text["per_layer_config"] if int(k) < SMALL_LAYERS}
        raw["canvas_length"] = SMALL_CANVAS
    if fp8:
        from blockdiff.model.quantize import FP8_DYNAMIC

        raw["quantization_config"] = FP8_DYNAMIC.to_dict()
    return raw


def _config_path(args, fp8: bool = False) -> str:
    path = os.path.join(args.out, "configs", "fp8" if fp8 else "bf16")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_config_raw(args, fp8), f)
    return path


def _batches(args) -> list[int]:
    return [int(b) for b in (args.batches or (SMALL_BATCHES if args.small else "1,8,16")).split(",")]


def _steps(args) -> int:
    return args.steps or (SMALL_STEPS if args.small else STEPS)


def _prompt_len(args) -> int:
    return 16 if args.small else 128


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [[2] + torch.randint(3, vocab, (length - 1,), generator=g).tolist() for _ in range(batch)]


def _params(canvases: int, canvas: int, steps: int):
    from blockdiff import SamplingParams

    # No early stop (a confidence no canvas reaches): every canvas takes all its steps.
    return SamplingParams(max_tokens=canvases * canvas, max_denoising_steps=steps, confidence_threshold=1e-30,
                          ignore_eos=True, seed=0)


def _peak(args):
    """(copy GB/s, matmul GFLOP/s) the bounds use: the nominal figures given, else measured here."""
    import torch

    from blockdiff.bench.roofline import measure_peak

    peak = measure_peak(args.device, torch.bfloat16)
    return (args.hbm_gbs or peak.bandwidth_gbs, args.peak_tflops * 1e3 if args.peak_tflops else peak.gflops,
            {"measured_copy_gbs": peak.bandwidth_gbs, "measured_matmul_gflops": peak.gflops, "nominal_gbs": args.hbm_gbs})


def _step_bound(config, batch: int, args, gbs: float, gflops: float, weight_bytes: float | None = None) -> dict:
    """The bound of one denoising step of `batch` canvases halfway through the second canvas."""
    from blockdiff.bench.roofline import bound, plan_cost
    from blockdiff.model.attention import Row

    cl, steps = config.canvas_length, _steps(args)
    rows = [Row(i, _prompt_len(args) + cl, cl, True) for i in range(batch)]
    cost = plan_cost(config, rows, [max(2, steps // 2)] * batch, 0, 2, weight_bytes)
    b = bound(cost, gbs, gflops)
    return {"bytes": cost.bytes, "flops": cost.flops, "memory_ms": 1e3 * b.memory_s, "compute_ms": 1e3 * b.compute_s,
            "bound_ms": 1e3 * b.seconds, "bound_limit": b.limit}


def _time_engine(args, record, fp8: bool, batches: list[int], layers: int | None = None, **engine) -> dict:
    """ms per denoising step and per canvas of the dummy model at each batch, recorded batch by batch."""
    import torch

    from blockdiff import LLM
    from blockdiff.model.registry import load_config
    from blockdiff.demo import demo_checkpoint
    from blockdiff.worker.canvas_step import canvas_step

    path = _config_path(args, fp8)
    config = load_config(path)
    if layers:
        config = config.first_layers(layers)
    cl, steps, prompt_len = config.canvas_length, _steps(args), _prompt_len(args)
    gbs, gflops, peaks = _peak(args)
    if fp8:
        gflops *= 2  # FP8 tensor cores: twice bfloat16's rate (nominal, not measured)
    record("peaks", peaks)
    t0 = time.perf_counter()
    out = {}
    with LLM(path, load_format="dummy", dtype="bfloat16", device=args.device, tokenizer=demo_checkpoint(),
             max_num_seqs=max(batches), max_model_len=prompt_len + 3 * cl, num_layers_override=layers, **engine) as llm:
        static = llm.engine.executor.runner.canvas_steps
        mode = "eager" if static is None else " and ".join(
            m for m, on in (("compiled", static.fn is not canvas_step), ("CUDA graphs", static.pool is not None)) if on)
        record("engine", {"mode": mode, "load_s": round(time.perf_counter() - t0, 1), "layers": config.num_layers,
                          "canvas": cl, "steps": steps, "prompt_tokens": prompt_len})
        say(f"  loaded in {time.perf_counter() - t0:.0f} s; steps of canvases: {mode}")
        for batch in batches:
            prompts = _prompts(batch, prompt_len, config.vocab_size)
            # warm-up over both canvases: the second canvas reads a longer prefix, another shape
            warm = _timed(lambda: llm.generate(prompts, _params(2, cl, steps), use_tqdm=False), args.device)
            one = _timed(lambda: llm.generate(prompts, _params(1, cl, steps), use_tqdm=False), args.device)
            outs = []
            two = _timed(lambda: outs.extend(llm.generate(prompts, _params(2, cl, steps), use_tqdm=False)), args.device)
            per_canvas = (two - one) * 1e3
            m = {"warmup_s": warm, "one_canvas_s": one, "two_canvases_s": two, "ms_per_canvas": per_canvas,
                 "ms_per_step": per_canvas / steps, "steps_per_canvas": [o.metrics["denoising_steps"] // 2 for o in outs],
                 **_step_bound(config, batch, args, gbs, gflops, 1 if fp8 else None)}
            m["fraction_of_bound"] = m["bound_ms"] / m["ms_per_step"]
            out[str(batch)] = m
            record("batches", out)
            say(f"  batch {batch}: {m['ms_per_step']:.2f} ms/step, {per_canvas:.1f} ms per canvas; bound {m['bound_ms']:.2f} ms "
                f"({m['bound_limit']}), {100 * m['fraction_of_bound']:.0f}% of it")
        if args.device.startswith("cuda"):
            record("peak_memory_gib", torch.cuda.max_memory_allocated() / 2**30)
    return {}


def part_env(args, record) -> dict:
    import importlib.metadata
    import importlib.util
    import platform

    import torch
    import torch.nn.functional as F

    from blockdiff.model.registry import parse_config
    from blockdiff.ops.kernels import FP8, INSTALLED, ExpertShape, expert_kernel, padded, static_kernel, step_modes, target

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "triton", "numpy", "safetensors", "tokenizers", "jinja2", "pytest", "fastapi"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    record("versions", versions)
    where = target(args.device)
    gpu = torch.cuda.get_device_name(args.device) if where.type == "cuda" else platform.processor() or platform.machine()
    record("gpu", gpu)
    if where.type == "cuda":
        props = torch.cuda.get_device_properties(args.device)
        record("device", {"capability": list(where.capability), "memory_gib": props.total_memory / 2**30,
                          "multiprocessors": props.multi_processor_count})
    config = parse_config(_config_raw(args))
    kernels = {}
    for label, weights, dtype, acts in (("bfloat16", torch.bfloat16, torch.bfloat16, None), ("fp8", FP8, torch.bfloat16, "dynamic"),
                                        ("float32", torch.float32, torch.float32, None)):
        shape = ExpertShape(padded(config.hidden_size, weights), padded(config.arch.moe_intermediate_size, weights), weights, acts)
        kernel, why = expert_kernel(where, dtype, shape)
        modes = step_modes(where, static_kernel(kernel), None, where.type == "cuda")
        kernels[label] = {"experts": kernel, "why": why, "compile": modes.compile, "cuda_graphs": modes.cuda_graphs,
                          "steps": modes.why}
    record("kernels", kernels)
    record("torch_ops", {"grouped_mm": INSTALLED.grouped_mm, "scaled_grouped_mm": INSTALLED.scaled_grouped_mm,
                         "cpu_grouped_mm": [str(d) for d in INSTALLED.cpu_grouped_mm]})
    # Which SDPA backends take the step's attention shapes (a canvas over its cached prefix, with
    # the boolean key mask the static step passes), as model/attention.py calls SDPA.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cl, dtype = config.canvas_length, torch.bfloat16 if where.type == "cuda" else torch.float32
    attention = {}
    for spec in {(s.sliding, s.head_dim, s.num_kv_heads) for s in config.arch.layers}:
        sliding, dim, kv = spec
        keys = cl + (config.sliding_window - 1 if sliding else 2 * cl)
        q = torch.randn(1, config.arch.num_heads, cl, dim, device=args.device, dtype=dtype)
        k = torch.randn(1, kv, keys, dim, device=args.device, dtype=dtype)
        mask = torch.ones(1, 1, 1, keys, dtype=torch.bool, device=args.device)
        works = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
            try:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, k, attn_mask=mask, scale=1.0, enable_gqa=kv != config.arch.num_heads)
                works[backend.name] = True
            except RuntimeError as e:
                works[backend.name] = str(e).splitlines()[0][:120]
        attention[f"{'sliding' if sliding else 'full'} head_dim {dim}, {kv} KV heads, {keys} keys"] = works
    record("sdpa_backends", attention)
    say(f"  {gpu}: bf16 experts {kernels['bfloat16']['experts']}, FP8 {kernels['fp8']['experts']}, float32 {kernels['float32']['experts']}")
    return {}


def part_headline(args, record) -> dict:
    return _time_engine(args, record, False, _batches(args), args.layers)


def part_steps_per_launch(args, record) -> dict:
    """K = 1 against the chosen K at the first and last batch, alternating in one engine built for K
    (the engine plans min(K, steps left) per launch from its executor's steps_per_launch); and K = 1
    without async scheduling (the engine's `async_scheduling`, read at every step)."""
    from blockdiff import LLM
    from blockdiff.config import STEPS_PER_LAUNCH
    from blockdiff.demo import demo_checkpoint
    from blockdiff.model.registry import load_config

    k = args.steps_per_launch or STEPS_PER_LAUNCH["cpu"]
    batches = _batches(args)
    batches = sorted({batches[0], 16 if not args.small else batches[-1]})
    path = _config_path(args)
    config = load_config(path)
    cl, steps, prompt_len = config.canvas_length, _steps(args), _prompt_len(args)
    out = {"k": k, "batches": {}}
    with LLM(path, load_format="dummy", dtype="bfloat16", device=args.device, tokenizer=demo_checkpoint(),
             max_num_seqs=max(batches), max_model_len=prompt_len + 3 * cl, num_layers_override=args.layers,
             num_scheduler_steps=k) as llm:
        executor = llm.engine.executor
        for batch in batches:
            prompts = _prompts(batch, prompt_len, config.vocab_size)
            runs = {(1, True): "k1", (k, True): f"k{k}", (1, False): "k1_sync"}
            times = {name: [] for name in runs.values()}
            for rep in range(3):  # the first round warms them up (and captures their graphs)
                for (launch, overlap), name in runs.items():
                    executor.steps_per_launch, llm.engine.async_scheduling = launch, overlap
                    one = _timed(lambda: llm.generate(prompts, _params(1, cl, steps), use_tqdm=False), args.device)
                    two = _timed(lambda: llm.generate(prompts, _params(2, cl, steps), use_tqdm=False), args.device)
                    if rep:
                        times[name].append((two - one) * 1e3 / steps)
            m = {f"{name}_ms_per_step": min(t) for name, t in times.items()}
            m["speedup"] = m["k1_ms_per_step"] / m[f"k{k}_ms_per_step"]
            m["async_speedup"] = m["k1_sync_ms_per_step"] / m["k1_ms_per_step"]
            out["batches"][str(batch)] = m
            record("steps_per_launch", out)
            say(f"  batch {batch}: K=1 {m['k1_ms_per_step']:.2f} ms/step, K={k} {m[f'k{k}_ms_per_step']:.2f} "
                f"({m['speedup']:.2f}x); K=1 without async scheduling {m['k1_sync_ms_per_step']:.2f} "
                f"({m['async_speedup']:.2f}x)")
        executor.steps_per_launch, llm.engine.async_scheduling = k, True
    return {}


def part_fp8(args, record) -> dict:
    batches = _batches(args)
    return _time_engine(args, record, True, [batches[0], batches[-1]], args.layers)


def _best_ms(fn, device: str, reps: int) -> float:
    fn()  # warm-up: Triton compiles (or the interpreter parses) the kernel for this shape
    return 1e3 * min(_timed(fn, device) for _ in range(reps))


def _bound(nbytes: float, flops: float, gbs: float, gflops: float) -> float:
    """ms the roofline allows: the larger of the bytes at the bandwidth and the FLOPs at the peak."""
    return 1e3 * max(nbytes / (gbs * 1e9), flops / (gflops * 1e9))


def part_kernels(args, record) -> dict:
    """Triton against the reference, kernel by kernel, at the model's shapes (the Triton side's
    compulsory bytes: Q, O and the K/V each canvas reads once; the sampler's: the logits read for the
    maxima and again for the statistics, the probabilities written and read once in bfloat16, and
    the embedding rows read for the self-conditioning product)."""
    import torch

    if not args.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined, on import
    from blockdiff.diffusion.sampler_kernels import sampler_kernels
    from blockdiff.parallel.self_conditioning import soft_embedding
    from blockdiff.diffusion.vocab_parallel import VocabParallel
    from blockdiff.model.attention import CacheGeometry, Row, build_metadata
    from blockdiff.model.registry import parse_config
    from blockdiff.parallel.group import TPGroup
    from blockdiff.parallel.vocab import VocabShard

    config = parse_config(_config_raw(args))
    arch, cl, device = config.arch, config.canvas_length, args.device
    dtype = torch.bfloat16
    gbs, gflops, peaks = _peak(args)
    record("peaks", peaks)
    batches = _batches(args) if args.small else [1, 8, 16]
    contexts = SMALL_KERNEL_CONTEXTS if args.small else KERNEL_CONTEXTS
    block, reps = 16, 1 if args.small else KERNEL_REPS  # the interpreter takes a second a call
    attention: dict = {}
    for sliding in (True, False):
        spec = next(layer for layer in arch.layers if layer.sliding == sliding)
        heads, kv, dim = arch.num_heads, spec.num_kv_heads, spec.head_dim
        for context in contexts:
            for batch in batches:
                blocks_per = -(-(context + cl) // block)
                tables = {s: torch.arange(batch * blocks_per).view(batch, blocks_per) for s in (True, False)}
                tables = {s: torch.cat((t, torch.full((1, blocks_per), -1))) for s, t in tables.items()}
                rows = [Row(i, context, cl, True) for i in range(batch)]
                g = torch.Generator(device).manual_seed(0)
                q = torch.randn(batch * cl, heads, dim, generator=g, device=device, dtype=dtype)
                k, v = (torch.randn(batch * cl, kv, dim, generator=g, device=device, dtype=dtype) for _ in range(2))
                cache = tuple(torch.randn(kv, batch * blocks_per * block, dim, generator=g, device=device, dtype=dtype)
                              for _ in range(2))
                times = {}
                for backend in ("triton", "reference"):
                    geo = CacheGeometry(block_size=block, window_past=config.sliding_window - 1,
                                        window=config.sliding_window, backend=backend)
                    kind = build_metadata(rows, geo, {sliding}, device, tables).kind(sliding)
                    times[backend] = _best_ms(lambda: kind.attend(q, k, v, cache), device, reps)
                keys = min(context, config.sliding_window - 1) if sliding else context
                flops = 4 * batch * cl * (keys + cl) * dim * heads
                nbytes = 2 * 2 * batch * cl * heads * dim + 2 * 2 * batch * (keys + cl) * kv * dim
                bound = _bound(nbytes, flops, gbs, gflops)
                attention[f"{'sliding' if sliding else 'full'} {batch} canvases, context {context}"] = {
                    "bytes": nbytes, "flops": flops, "bound_ms": bound, "triton_ms": times["triton"],
                    "reference_ms": times["reference"], "triton_fraction": bound / times["triton"],
                    "speedup": times["reference"] / times["triton"]}
                record("attention", attention)
                say(f"  attention {'sliding' if sliding else 'full'} x{batch} at {context}: Triton {times['triton']:.3f} ms, "
                    f"reference {times['reference']:.3f} ms, bound {bound:.3f} ms")
    vocab, hidden = config.vocab_size, config.hidden_size
    weight = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
    shard = VocabShard.make(0, 1, vocab)
    sampler: dict = {}
    for batch in batches:
        logits = torch.randn(batch, cl, vocab, device=device) * 4
        u = torch.rand(batch, cl, device=device)
        times = {}
        for backend in ("triton", "reference"):
            sampling = VocabParallel(shard, TPGroup(), device, kernels=sampler_kernels(backend))
            work = torch.empty_like(logits)

            def step():
                work.copy_(logits)  # the statistics shift the logits in place
                d = sampling.distribution(work)
                sampling.argmax_and_sample(d, u)
                # as the model embeds them (DiffusionGemma.soft_embed): in its dtype, scaled by 1 / total
                sampling.soft_embed(d, None, lambda p, t: soft_embedding(p.to(dtype), weight, (1.0 / t).unsqueeze(-1)), dtype)

            times[backend] = _best_ms(step, device, reps)
        positions = batch * cl
        nbytes = 4 * positions * vocab * 3 + 2 * positions * vocab * 2 + 2 * vocab * hidden  # copy, 2 reads; probs; E
        flops = 2 * positions * vocab * hidden
        bound = _bound(nbytes, flops, gbs, gflops)
        sampler[f"{batch} canvases"] = {"bytes": nbytes, "flops": flops, "bound_ms": bound, "triton_ms": times["triton"],
                                        "reference_ms": times["reference"], "triton_fraction": bound / times["triton"],
                                        "speedup": times["reference"] / times["triton"]}
        record("sampler", sampler)
        say(f"  sampler x{batch}: Triton {times['triton']:.3f} ms, reference {times['reference']:.3f} ms, bound {bound:.3f} ms")
        del logits
    return {}


def part_transformers(args, record) -> dict:
    import torch
    import transformers
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    raw = _config_raw(args)
    if args.layers:
        text = raw["text_config"]
        text["num_hidden_layers"] = args.layers
        text["layer_types"] = text["layer_types"][: args.layers]
        text["per_layer_config"] = {k: v for k, v in text["per_layer_config"].items() if int(k) < args.layers}
    record("version", transformers.__version__)
    t0 = time.perf_counter()
    with torch.device(args.device):
        hf = DiffusionGemmaForBlockDiffusion._from_config(DiffusionGemmaConfig.from_dict(raw), dtype=torch.bfloat16).eval()
    say(f"  transformers {transformers.__version__}: model made in {time.perf_counter() - t0:.0f} s")
    cl, steps = raw["canvas_length"], _steps(args)
    ids = torch.tensor(_prompts(1, _prompt_len(args), raw["text_config"]["vocab_size"]), device=args.device)

    def generate(canvases: int):
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=canvases * cl, max_denoising_steps=steps, confidence_threshold=1e-30)

    generate(2)
    one = _timed(lambda: generate(1), args.device)
    two = _timed(lambda: generate(2), args.device)
    per_canvas = 1e3 * (two - one)
    say(f"  batch 1: {per_canvas / steps:.2f} ms/step, {per_canvas:.1f} ms per canvas")
    return {"one_canvas_s": one, "two_canvases_s": two, "ms_per_canvas": per_canvas, "ms_per_step": per_canvas / steps}


def _pytest(args, selection: list[str], env: dict) -> dict:
    left = max(10.0, args.deadline - time.time() - 5)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    # The selections use no pytest plugin; importing every one the machine has installed (hypothesis,
    # schemathesis, langsmith, ...) took seconds per run.
    env = {**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
        lines, passed = (proc.stdout + proc.stderr).strip().splitlines(), proc.returncode == 0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines, passed = out.strip().splitlines() + [f"timed out after {left:.0f} s"], False
    result = {"passed": passed, "summary": lines[-1] if lines else "", "seconds": round(time.perf_counter() - t0, 1)}
    if not passed:
        result["tail"] = lines[-40:]
    return result


def part_tests(args, record) -> dict:
    env = {**os.environ, "BLOCKDIFF_TEST_DEVICE": args.device,
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    results = {}
    for name, selection in TEST_SELECTIONS.items():
        results[name] = _pytest(args, (["--collect-only"] if args.small else []) + selection, env)
        record("selections", results)
        say(f"  {name}: {results[name]['summary']}")
    failed = [n for n, r in results.items() if not r["passed"]]
    if failed:
        raise RuntimeError(f"tests failed: {', '.join(failed)}")
    return {}


def part_compiled(args, record) -> dict:
    """6 layers at batch 1: compiled against uncompiled static steps (both CUDA graphs on a GPU)."""
    import torch

    from blockdiff import LLM
    from blockdiff.model.registry import load_config
    from blockdiff.demo import demo_checkpoint
    from blockdiff.worker.canvas_step import COMPILE_OPTIONS, canvas_step

    path = _config_path(args)
    layers = SMALL_COMPILED_LAYERS if args.small else COMPILED_LAYERS
    config = load_config(path)
    cl, steps, prompts = config.canvas_length, _steps(args), _prompts(1, _prompt_len(args), config.vocab_size)
    result = {"layers": layers, "backend": args.compile_backend}
    for name, compile in (("eager", False), ("compiled", True)):
        with LLM(path, load_format="dummy", dtype="bfloat16", device=args.device, tokenizer=demo_checkpoint(), max_num_seqs=1,
                 max_model_len=_prompt_len(args) + 3 * cl, num_layers_override=layers, compile=compile) as llm:
            steps_of = llm.engine.executor.runner.canvas_steps
            if compile and args.compile_backend != "inductor":
                steps_of.fn = torch.compile(canvas_step, backend=args.compile_backend, **COMPILE_OPTIONS)
            warm = _timed(lambda: llm.generate(prompts, _params(2, cl, steps), use_tqdm=False), args.device)
            one = _timed(lambda: llm.generate(prompts, _params(1, cl, steps), use_tqdm=False), args.device)
            two = _timed(lambda: llm.generate(prompts, _params(2, cl, steps), use_tqdm=False), args.device)
        result[f"{name}_warmup_s"] = warm
        result[f"{name}_ms_per_step"] = 1e3 * (two - one) / steps
        record(name, {"warmup_s": warm, "ms_per_step": result[f"{name}_ms_per_step"]})
        say(f"  {name}: warm-up {warm:.1f} s, {result[f'{name}_ms_per_step']:.2f} ms/step")
    result["compile_s"] = result["compiled_warmup_s"] - result["eager_warmup_s"]
    result["speedup"] = result["eager_ms_per_step"] / result["compiled_ms_per_step"]
    return result


def part_fake_cuda(args, record) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "BLOCKDIFF_TEST_DEVICE": "cpu",  # the fake device, on a torch that sees no GPU
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    result = _pytest(args, (["--collect-only"] if args.small else []) + ["tests/ops/test_fake_cuda.py", "tests/ops/test_kernels.py"], env)
    record("selections", {"fake CUDA and kernel choice": result})
    say(f"  {result['summary']}")
    if not result["passed"]:
        raise RuntimeError("the fake-CUDA tests failed")
    return {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny widths of the same structure (CI runs this on the CPU)")
    p.add_argument("--out", default=os.path.join(ROOT, "device_check_out"))
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole check; parts that do not fit are skipped")
    p.add_argument("--parts", default=None, help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out")
    p.add_argument("--timeout-s", type=float, default=None, help="the most seconds any one part may run")
    p.add_argument("--fail-part", default=None, help="make this part raise before it starts (checks that the others' results stay)")
    p.add_argument("--hang-part", default=None, help="make this part hang after its first result (checks the time-out)")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8,16; --small: 1,2)")
    p.add_argument("--steps", type=int, default=None, help=f"denoising steps per canvas (default {STEPS}; --small: {SMALL_STEPS})")
    p.add_argument("--layers", type=int, default=None, help="--num-layers-override for the timed models")
    p.add_argument("--steps-per-launch", type=int, default=None,
                   help="the K the steps_per_launch part measures against 1 (default: the CPU's, config.STEPS_PER_LAUNCH)")
    p.add_argument("--hbm-gbs", type=float, default=None, help="nominal memory bandwidth, GB/s (H200: 4800); default: measured")
    p.add_argument("--peak-tflops", type=float, default=None, help="bfloat16 matmul rate for the FLOP bound; default: measured")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend of the compiled part (default inductor; --small: eager)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # the child's part
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.parts = [x for x in args.parts.split(",") if x] if args.parts else None
    args.skip = {x for x in args.skip.split(",") if x}
    unknown = set(args.parts or ()) | args.skip | {x for x in (args.fail_part, args.hang_part) if x}
    if unknown - set(PARTS):
        p.error(f"unknown parts: {', '.join(sorted(unknown - set(PARTS)))} (parts: {', '.join(PARTS)})")
    args.compile_backend = args.compile_backend or ("eager" if args.small else "inductor")
    if args.part:
        sys.path.insert(0, ROOT)
        return run_part(args)
    passthrough = [a for a in sys.argv[1:]]
    return run_all(args, passthrough)


if __name__ == "__main__":
    sys.exit(main())
