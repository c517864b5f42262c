"""Imports only point down the layers (pyproject's [tool.importlinter] contract, docs/architecture.md)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_imports_only_point_down():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout + r.stderr


def test_the_contract_has_at_most_ten_floors_and_names_every_package():
    """The drawing stays short, and no module of blockdiff sits outside it, `__main__` included
    (unlisted, a module's imports would go unchecked)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        (contract,) = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    floors = contract["layers"]
    assert len(floors) <= 10, floors
    listed = {name.strip().removeprefix("blockdiff.") for floor in floors for name in floor.split("|")}
    package = os.path.join(ROOT, "blockdiff")
    present = {n.removesuffix(".py") for n in os.listdir(package)
               if (n.endswith(".py") or os.path.isdir(os.path.join(package, n, ""))) and n not in ("__init__.py", "__pycache__")}
    assert present == listed, (present - listed, listed - present)
