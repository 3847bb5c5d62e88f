#!/usr/bin/env bash
# Creates (once) a virtual environment with requirements-test.txt installed, outside the clone
# and keyed by the requirements' hash, so CI and fresh checkouts reuse it instead of downloading
# PyTorch again. Prints the environment's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${SDPA_MATH_CACHE:-$HOME/.cache/sdpa_math}"
key=$( (cat requirements-test.txt; python3 --version) | sha256sum | cut -c1-16)
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "setup_python: creating $venv (first run downloads PyTorch; later runs reuse it)" >&2
  mkdir -p "$cache"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r requirements-test.txt >&2
  touch "$venv/.complete"
fi
echo "$venv"
