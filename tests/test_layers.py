"""Imports only point down the layers (pyproject's [tool.importlinter] contract, docs/architecture.md)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_imports_only_point_down():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout + r.stderr
