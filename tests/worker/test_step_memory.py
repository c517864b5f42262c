"""A whole generate's memory: its peak resident set beyond what the process held before stays within
1.5 float32 logits tensors of the batch, the logits and the sampler's tile of temporaries
(benchmarks/step_memory.py, at a smaller vocabulary with the sampler's workspace scaled to it), with
glibc's default heap, whose resident set follows the live tensors, and with the heap the `blockdiff`
commands keep (freed memory kept for reuse, worker/cpu_heap.py). Before, two denoising steps of a
launch held both steps' logits, and the sampler's weights made a cast copy of their mask: 2.6x. In
the kept heap, a step's logits made after the forward's small tensors had split the block the step
before freed: 1.88x on a CPU with AVX-512."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "step_memory.py")
LIMIT = 1.5  # one float32 logits tensor of the batch, and half of one for everything else


@pytest.mark.parametrize("heap", ["--plain-heap", None], ids=["glibc-defaults", "kept-freed-memory"])
def test_a_generate_of_8_canvases_holds_at_most_one_and_a_half_logits(tmp_path, heap):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, _SCRIPT, "--vocab", "32768", "--workdir", str(tmp_path)] + ([heap] if heap else []),
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ratio = float(re.search(r"whole generate: peak growth [\d.]+ GiB, ([\d.]+)x the logits", out.stdout).group(1))
    assert ratio <= LIMIT, out.stdout
    # 8 canvases of 256 tokens each went through the step being measured
    assert "2048 tokens generated" in out.stdout, out.stdout
