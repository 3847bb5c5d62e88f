#!/usr/bin/env bash
# The main job: sets up (the cached test environment with PyTorch, scripts/setup_python.sh),
# builds and installs the package, and runs the demo: sdpa_math on a small model and a built-in
# input, on the GPU when there is one, else the CPU; it prints errors and times against PyTorch's
# math op and eager attention, per-head entropy, and where it wrote the heatmaps.
# Arguments go to the demo (--device, --out).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv=$(bash scripts/setup_python.sh | tail -n 1)
"$venv/bin/pip" install -q --no-build-isolation .
"$venv/bin/python" -m sdpa_math demo "$@"
