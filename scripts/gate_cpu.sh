#!/usr/bin/env bash
# The performance gate on the small CPU set: run the benchmark and the statistics benchmark,
# compare their same-run ratios with the committed baselines (bench/baselines/cpu-ci.json and
# cpu-ci-stats.json: the statistics forward and kl_to's forward + backward against the math op's
# P and against flash attention). Usage: gate_cpu.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-$(bash scripts/setup_python.sh | tail -n 1)}
out=build/bench-ci
# Run from outside the tree so the installed package (the code under test) is what is imported.
(cd /tmp && "$venv/bin/python" -m sdpa_math bench run --device cpu --set ci --dtypes float32 --out "$OLDPWD/$out")
(cd /tmp && "$venv/bin/python" -m sdpa_math bench stats --device cpu --set ci --dtypes float32 --out "$OLDPWD/$out")
status=0
"$venv/bin/python" -m sdpa_math bench gate "$out/bench.json" bench/baselines/cpu-ci.json --threshold 0.5 || status=1
"$venv/bin/python" -m sdpa_math bench gate "$out/stats.json" bench/baselines/cpu-ci-stats.json --threshold 0.5 || status=1
exit $status
