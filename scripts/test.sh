#!/usr/bin/env bash
# Sets up, builds and runs every test: the C++ core (GoogleTest through CTest), then the Python
# package against PyTorch (pytest), in a cached virtual environment (scripts/setup_python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build -j"$(nproc)" --output-on-failure
venv=$(bash scripts/setup_python.sh | tail -n 1)
"$venv/bin/pip" install -q --no-build-isolation .
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python
