#!/usr/bin/env bash
# Sets up, builds and runs every test: the C++ core (GoogleTest through CTest), then the Python
# package against PyTorch (pytest; the GPU tests skip without a GPU), in a cached virtual
# environment (scripts/setup_python.sh), then the performance gate on the small CPU set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build -j"$(nproc)" --output-on-failure
venv=$(bash scripts/setup_python.sh | tail -n 1)
"$venv/bin/pip" install -q --no-build-isolation .
# A fresh inductor cache per run: compiled graphs must not outlive the op schemas they call.
export TORCHINDUCTOR_CACHE_DIR="$PWD/build/inductor-cache"
rm -rf "$TORCHINDUCTOR_CACHE_DIR"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python
bash scripts/gate_cpu.sh "$venv"
