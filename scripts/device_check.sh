#!/usr/bin/env bash
# The device check of issue 11: oracle tests on the device, the compiled step's graph replay, and
# DiffusionGemma-26B-A4B with dummy weights against the HBM roofline and transformers
# (scripts/device_check.py says what each part measures). Fits 8 minutes on one H200:
#
#   bash scripts/device_check.sh                       # cuda, the real widths, H200 bandwidth
#   bash scripts/device_check.sh --device cpu --small  # the same script on tiny shapes (CI runs it)
#
# It uses the machine's own torch. Pure-Python wheels missing there (transformers 5.23.0, the
# tests' oracle) are carried in .device-wheels/ (git-ignored; fetch them once with
# `pip download transformers==5.23.0 --no-deps -d .device-wheels`, send them with the run) and
# installed into a temporary directory on PYTHONPATH, never into the machine's environment.
# Writes device_check_out/device_check.json and device_check.txt (or --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
# Only the wheels whose version is not installed already.
missing=()
for wheel in .device-wheels/*.whl; do
  [[ -e "$wheel" ]] || continue
  IFS=- read -r name version _ <<< "$(basename "$wheel")"
  if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(m.version('$name') != '$version')" 2> /dev/null; then
    missing+=("$wheel")
  fi
done
if (( ${#missing[@]} )); then
  target=$(mktemp -d)
  "$PYTHON" -m pip install -q --no-deps --no-index --target "$target" "${missing[@]}"
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
args=("$@")
if [[ " $* " != *" --device "* ]]; then
  args+=(--device cuda)
fi
if [[ " $* " != *" --small "* && " $* " != *" --hbm-gbs "* && " $* " != *" cpu "* ]]; then
  args+=(--hbm-gbs 4800)  # H200
fi
exec "$PYTHON" scripts/device_check.py "${args[@]}"
