#!/usr/bin/env bash
# Creates .venv with blockdiff and its test dependencies. torch is installed first, pinned: on these
# machines torch==2.13.0 is a CPU build on local disk, while an open range would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
