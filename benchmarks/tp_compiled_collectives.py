"""The all-reduce of a compiled step against the eager one, on a real gloo group of two processes
(blockdiff.parallel.group.connect): the eager path calls the c10d backend in place; under
torch.compile TPGroup.all_reduce is a functional collective (traced into the graph, then copied back
in place). Per call, median µs of 200 after 20 warm-ups, for the sizes a step reduces: the MoE /
attention output of one 256-token canvas at the 26B-A4B width (float32 on CPU) and the tiny test
model's. Also whether the backend's own call compiles at all (fullgraph=True).

    OMP_NUM_THREADS=1 python benchmarks/tp_compiled_collectives.py
"""

import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from blockdiff.parallel.group import connect


def bench(fn, x) -> float:
    for _ in range(20):
        fn(x)
    times = []
    for _ in range(200):
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def rank_main(rank: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    group = connect(rank, 2, store, torch.device("cpu"), datetime.timedelta(seconds=60))

    def step(x):  # a product, the reduce, a product after it: as a row-parallel block sits in a step
        y = x * 2
        group.all_reduce(y)
        return y + 1

    def raw(x):
        y = x * 2
        group.backend.allreduce([y], dist.ReduceOp.SUM).wait()
        return y + 1

    try:
        torch.compile(raw, fullgraph=True, backend="eager")(torch.ones(4))
        raw_compiles = "yes"
    except Exception as e:  # noqa: BLE001 - the point is what happens
        raw_compiles = f"no ({type(e).__name__}: {str(e).splitlines()[0]})"
    t = time.perf_counter()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    compiled(torch.ones(256, 2816))
    first = time.perf_counter() - t
    for rows, width in ((256, 2816), (64, 48)):
        x = torch.full((rows, width), float(rank + 1))
        assert torch.equal(compiled(x), step(x))
        eager_us, compiled_us = bench(step, x), bench(compiled, x)
        if rank == 0:
            print(f"[{rows} x {width}] float32 all-reduce in a step: eager (c10d in place) {eager_us:.0f} µs, "
                  f"compiled (functional, inductor) {compiled_us:.0f} µs, eager/compiled {eager_us / compiled_us:.2f}x", flush=True)
    if rank == 0:
        print(f"the backend's own allreduce under fullgraph=True compiles: {raw_compiles}")
        print(f"first inductor compile of the functional version: {first:.1f} s")
    group.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank_main(int(sys.argv[1]), int(sys.argv[2]))
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        other = subprocess.Popen([sys.executable, __file__, "1", str(port)], env=os.environ)
        rank_main(0, port)
        other.wait(timeout=120)
