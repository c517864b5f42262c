#!/usr/bin/env bash
# Creates .venv with blockdiff and its test dependencies. torch is installed first, pinned: on these
# machines torch==2.13.0 is a CPU build on local disk, while an open range would pull a CUDA build.
# One line per stage says what runs (pip itself is quiet), so a long install is not mistaken for a hang.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo "setup.sh [$SECONDS s]: $*"; }
stage "creating the virtual environment .venv"
python3 -m venv .venv
stage "upgrading pip"
.venv/bin/python -m pip install -q --upgrade pip
stage "installing torch==2.13.0 (before anything that depends on it)"
.venv/bin/python -m pip install -q torch==2.13.0
stage "installing blockdiff and its test extra (pip install -e '.[test]', torch pinned by scripts/constraints.txt; the longest stage)"
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
stage "building blockdiff's CPU kernels where this CPU runs them (AVX512-BF16: about 25 s, kept in ~/.cache/torch_extensions)"
.venv/bin/python -c "from blockdiff.ops import cpu_grouped; cpu_grouped.extension()"
stage "done: .venv/bin/blockdiff and .venv/bin/python -m pytest are ready"
