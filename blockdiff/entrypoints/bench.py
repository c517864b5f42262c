"""`blockdiff bench offline|serve|plot`: the offline and serving benchmarks (see docs/benchmarks.md)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from blockdiff.bench import offline, plot, serve

    p = sub.add_parser("bench", help="benchmark the engine offline or a running server")
    bench = p.add_subparsers(dest="bench_command", required=True)
    off = bench.add_parser("offline", help="latency and throughput of LLM.generate, optionally against transformers")
    offline.add_arguments(off)
    off.set_defaults(func=offline.run)
    srv = bench.add_parser("serve", help="load an OpenAI-compatible server like `vllm bench serve`")
    serve.add_arguments(srv)
    srv.set_defaults(func=serve.run)
    plt = bench.add_parser("plot", help="plot latency and throughput against concurrency from bench serve results")
    plot.add_arguments(plt)
    plt.set_defaults(func=plot.run)
