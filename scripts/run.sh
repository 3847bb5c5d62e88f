#!/usr/bin/env bash
# The main job: sets up (the cached test environment with PyTorch, scripts/setup_python.sh),
# builds and installs the package, and runs the demo: a tiny Llama-style model learns an induction
# head with an attention-entropy term through P (sdpa_math.attention), on the GPU when there is
# one, else the CPU; it prints accuracy and entropy before and after, the error of O and P against
# PyTorch's math op, and where it drew the maps before and after training.
# Arguments go to the demo (--device, --out, --steps, --seed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
venv=$(bash scripts/setup_python.sh | tail -n 1)
"$venv/bin/pip" install -q --no-build-isolation .
"$venv/bin/python" -m sdpa_math demo "$@"
