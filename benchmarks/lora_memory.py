"""What holds a LoRA server's resident memory once it has served a while (docs/server.md, "LoRA
adapters and memory"): a real `blockdiff serve` of the demo checkpoint, with and without
--enable-lora (--max-loras 1 --max-cpu-loras 1, two PEFT adapters of rank 16 on every projection
served in turn, then runtime loads and unloads), its RSS after each phase split by /proc/PID/smaps
into the main heap, other anonymous memory (glibc's thread arenas, Python's and torch's own
mappings) and files, then glibc's malloc_stats (through gdb: per arena, bytes taken from the
system against bytes in use) and its RSS after malloc_trim(0).

    python benchmarks/lora_memory.py [--seconds S]

Needs gdb and ptrace rights over a child process for the allocator figures (else they are
skipped). About 2-3 minutes of CPU on 2 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from server_process import ServerProcess, rss_mib  # noqa: E402  (the test suite's)

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "blockdiff", "demo", "checkpoint")
TARGET = (r".*model\.(?:encoder\.language_model|decoder)\.(?:layers\.\d+\.(?:self_attn|mlp)\.(?:q|k|v|o|gate|up|down)_proj"
          r"|self_conditioning\.(?:gate|up|down)_proj)")


def adapter(root: str, i: int) -> str:
    import peft
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    out = os.path.join(root, f"a{i}")
    torch.manual_seed(i)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(DEMO, dtype=torch.float32)
    peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGET,
                                            init_lora_weights=False)).save_pretrained(out)
    return out


def held(path: str) -> None:
    """What LoRA itself holds: the device pool (--max-loras 1, rank 16) and one adapter's host copy."""
    import torch

    from blockdiff.model.loader import load_model
    from blockdiff.model.lora import lora_pools, read_adapter
    from blockdiff.model.lora_layers import enable_lora

    model = load_model(DEMO, dtype=torch.float32, device="cpu")
    enable_lora(model, 1, 16)
    pools = sum(b.numel() * b.element_size() for p in lora_pools(model).values() for b in (p.a, p.b))
    copy = sum(t.numel() * t.element_size() for a, b, _, _ in read_adapter(path).deltas.values() for t in (a, b))
    print(f"LoRA pools {pools / 2**20:.2f} MiB, one adapter's host copy {copy / 2**20:.2f} MiB", flush=True)


def smaps(pid: int) -> dict[str, float]:
    """Resident MiB by kind of mapping."""
    out = {"heap": 0.0, "anon": 0.0, "file": 0.0}
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                name = line.split(maxsplit=5)[5].strip() if len(line.split()) > 5 else ""
                kind = "heap" if name == "[heap]" else "file" if name.startswith("/") else "anon"
            elif line.startswith("Rss:"):
                out[kind] += int(line.split()[1]) / 1024
    return out


def gdb(pid: int, *calls: str) -> bool:
    cmd = ["gdb", "-p", str(pid), "-batch", "-nx"] + [a for c in calls for a in ("-ex", f"call {c}")]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def arenas(log: str) -> tuple[int, float, float]:
    """(arenas, MiB taken from the system, MiB in use) of the last malloc_stats in the log."""
    stats = log[log.rindex("Arena 0:"):]
    system = [int(x) for x in re.findall(r"^system bytes\s*=\s*(\d+)", stats, re.M)]
    used = [int(x) for x in re.findall(r"^in use bytes\s*=\s*(\d+)", stats, re.M)]
    n = len(re.findall(r"^Arena \d+:", stats, re.M))
    return n, sum(system[:n]) / 2**20, sum(used[:n]) / 2**20


CLIENTS = 16  # --max-num-seqs: every slot busy


def load(server: ServerProcess, models: list[str], seconds: float) -> int:
    """Completions of ~460-token prompts from CLIENTS client threads for `seconds`, the models in
    turn; -> how many."""
    end, done = time.monotonic() + seconds, [0]

    def client(k: int) -> None:
        i = k
        while time.monotonic() < end:
            r = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": models[i % len(models)], "prompt": f"{i} the cat sat on the mat " * 20, "max_tokens": 64})
            assert r.status_code == 200, r.text
            done[0] += 1
            i += 1

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    return done[0]


def report(server: ServerProcess, phase: str) -> None:
    m = smaps(server.proc.pid)
    print(f"  {phase:<44} RSS {rss_mib(server.proc.pid):7.0f} MiB  (heap {m['heap']:5.0f}, other anonymous "
          f"{m['anon']:5.0f}, files {m['file']:4.0f})", flush=True)


def run(lora: bool, root: str, paths: list[str], seconds: float) -> None:
    print(("with" if lora else "without") + " --enable-lora:", flush=True)
    args = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "16",
            "--lora-modules", f"a={paths[0]}", f"b={paths[1]}", "--lora-modules-dir", root] if lora else []
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(None, *args, log_path=os.path.join(tmp, "server.log"))
        try:
            report(server, "started")
            n = load(server, ["demo"], seconds)
            report(server, f"{n} base-model completions")
            if lora:
                n = load(server, ["a", "b"], seconds)
                report(server, f"{n} completions, adapters a and b in turn")
                for i in range(200):
                    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": f"r{i}", "lora_path": "a0"})
                    assert r.status_code == 200, r.text
                    httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": f"r{i}"})
                report(server, "200 runtime loads and unloads")
            if gdb(server.proc.pid, "(void)malloc_stats()"):
                time.sleep(0.5)
                count, system, used = arenas(server.log())
                print(f"  glibc: {count} arenas, {system:.0f} MiB taken from the system, {used:.0f} MiB of it in use",
                      flush=True)
                gdb(server.proc.pid, "(int)malloc_trim(0)")
                report(server, "after malloc_trim(0)")
            else:
                print("  (gdb cannot attach: no allocator figures)")
        finally:
            server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of load per phase")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        paths = [adapter(root, i) for i in range(2)]
        size = sum(os.path.getsize(os.path.join(p, "adapter_model.safetensors")) for p in paths) / 2**20
        print(f"two adapters of rank 16, {size:.1f} MiB of safetensors together", flush=True)
        held(paths[0])
        run(False, root, paths, args.seconds)
        run(True, root, paths, args.seconds)


if __name__ == "__main__":
    main()
