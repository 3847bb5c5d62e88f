#!/usr/bin/env bash
# The performance gate on the small CPU set: run the benchmark, compare its same-run ratios with
# the committed baseline (bench/baselines/cpu-ci.json). Usage: gate_cpu.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-$(bash scripts/setup_python.sh | tail -n 1)}
out=build/bench-ci
# Run from outside the tree so the installed package (the code under test) is what is imported.
(cd /tmp && "$venv/bin/python" -m sdpa_math bench run --device cpu --set ci --dtypes float32 --out "$OLDPWD/$out")
"$venv/bin/python" -m sdpa_math bench gate "$out/bench.json" bench/baselines/cpu-ci.json --threshold 0.5
