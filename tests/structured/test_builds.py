"""A structured-output build runs `blockdiff.structured.index` in a fresh interpreter that imports
parallel/processes.py as a module of the package, and never torch."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from blockdiff.structured.builds import Build, BuildPool


def test_a_build_child_imports_the_package_without_torch():
    code = "import sys, blockdiff.structured.index; print(sorted(m for m in ('torch', 'blockdiff.parallel.processes') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['blockdiff.parallel.processes']"


def test_the_pool_builds_an_automaton_in_a_child():
    pool = BuildPool(1, timeout=120.0, memory=2**31, done=lambda build, outcome: outcome)
    tokens = [b"a", b"b", b"c", None]  # token 3 is never allowed
    build = Build("ab|c", "client", pickle.dumps((("regex", "ab|c"), tokens, len(tokens), 1000, 1000)))
    try:
        pool.submit(build)
        arrays = build.future.result(timeout=120)
    finally:
        pool.close()
    assert not isinstance(arrays, BaseException), arrays
    assert arrays["atom_of"].shape == (len(tokens),)
