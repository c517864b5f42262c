"""`blockdiff bench plot`: latency and throughput against concurrency from `bench serve` results.

matplotlib is an optional dependency (`pip install 'blockdiff[plot]'`), imported only here.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="JSON files written by `blockdiff bench serve --save-result`")
    p.add_argument("--output", default="latency_vs_concurrency.png", help="PNG file to write")
    p.add_argument("--title", default=None)


def load_points(paths: list[str]) -> list[dict]:
    """One point per result file, ordered by concurrency (the prompts in flight at most)."""
    points = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        concurrency = r.get("max_concurrency") or r.get("num_prompts")
        if concurrency is None or "median_e2el_ms" not in r:
            raise ValueError(f"{path} is not a `blockdiff bench serve` result (no concurrency or end-to-end latency)")
        points.append({"concurrency": concurrency, **r})
    return sorted(points, key=lambda p: p["concurrency"])


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("bench plot needs matplotlib: pip install 'blockdiff[plot]'") from None
    points = load_points(args.results)
    x = [p["concurrency"] for p in points]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (
        ("median_e2el_ms", "end-to-end, median", "o-"),
        ("p99_e2el_ms", "end-to-end, P99", "o--"),
        ("median_ttft_ms", "first token (first canvas), median", "s-"),
        ("median_itl_ms", "between canvases (ITL), median", "^-"),
    ):
        if all(key in p for p in points):
            lat.plot(x, [p[key] / 1000 for p in points], style, label=label)
    lat.legend(fontsize=8)
    thr.plot(x, [p["output_throughput"] for p in points], "o-", label="output tokens/s")
    for ax, ylabel in ((lat, "latency (s)"), (thr, "output throughput (tok/s)")):
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(c) for c in x])
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(args.title or f"blockdiff bench serve: {points[0].get('model_id', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"plot written to {args.output}")
    return 0
