"""scripts/device_check.sh --device cpu --small: the device check's every part on tiny shapes, so
that the script the GPU runs cannot rot (its figures on a GPU are in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_device_check_runs_on_the_cpu_at_small_shapes(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/device_check.sh", "--device", "cpu", "--small", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["device"] == "cpu" and report["small"] and report["layers"] == 6
    tests = report["tests"]["parity and generation"]
    assert tests["passed"] and tests["collected_only"]
    assert int(re.search(r"(\d+)(/\d+)? tests? collected", tests["summary"]).group(1)) > 0
    assert set(report["blockdiff"]["batches"]) == {"1", "2"}
    for batch, b in report["blockdiff"]["batches"].items():
        assert b["two_canvases_s"] > b["one_canvas_s"] > 0
        assert report["roofline"][batch]["bytes_per_step"] > 0
    assert report["transformers"]["version"] and report["transformers"]["one_canvas_s"] > 0
    text = (tmp_path / "device_check.txt").read_text()
    assert text == proc.stdout and "ms/step" in text and "transformers" in text
