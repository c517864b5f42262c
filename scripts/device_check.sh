#!/usr/bin/env bash
# The device check (docs/device_check.md): what one lent GPU can tell in a few minutes, written to
# DIR/device_check.json after every part and every batch (scripts/device_check.py says what each
# part measures), so a time-out or a crash still brings back what was measured before it.
#
#   bash scripts/device_check.sh --out DIR                      # cuda, the real widths, H200 bandwidth
#   bash scripts/device_check.sh --device cpu --small --out DIR # the same parts on tiny shapes (CI runs it)
#
# It uses the machine's own torch. Pure-Python wheels missing there (transformers 5.23.0, the
# tests' oracle; pytest and its dependencies) are carried in .device-wheels/ (git-ignored; see
# docs/device_check.md; DEVICE_WHEELS names another folder) and installed into a temporary
# directory on PYTHONPATH, never into the machine's environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
# Only the wheels whose version is not installed already.
missing=()
for wheel in "${DEVICE_WHEELS:-.device-wheels}"/*.whl; do
  [[ -e "$wheel" ]] || continue
  IFS=- read -r name version _ <<< "$(basename "$wheel")"
  if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(m.version('$name') != '$version')" 2> /dev/null; then
    missing+=("$wheel")
  fi
done
if (( ${#missing[@]} )); then
  target=$(mktemp -d)
  # One wheel at a time: a bad one costs the parts that need it (they fail and say why), not the run.
  for wheel in "${missing[@]}"; do
    timeout 60 "$PYTHON" -m pip install -q --no-deps --no-index --target "$target" "$wheel" \
      || echo "device_check.sh: could not install $wheel; the parts that need it will fail" >&2
  done
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
exec "$PYTHON" -u scripts/device_check.py "${args[@]}"
