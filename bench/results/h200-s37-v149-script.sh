#!/usr/bin/env bash
# session 37, run v149: the harness (anchors+variants, fp16 + bf16, forward and f+b) and the
# statistics rows on v148's pip build (rebuilt if the machine came back cold), gated against the
# baselines; the raw results become the H200 baselines.
set -uo pipefail
export PYTHONUNBUFFERED=1
s=$(date +%s)
if [ -d build/site37/sdpa_math ]; then echo "v148's pip build is here"; export PYTHONPATH=$PWD/build/site37
else bash scripts/gpu_run.sh none > $OUT/gpu_run.txt 2>&1; tail -2 $OUT/gpu_run.txt; export PYTHONPATH=/tmp/site; fi
python3 -c "import sdpa_math; print(sdpa_math.__file__)"
timeout 230 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT/bench 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/bench/bench.json bench/baselines/h200.json --subset 2>&1 | tail -14
echo "bench done at $(( $(date +%s)-s )) s"
timeout 150 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT/stats 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/stats/stats.json bench/baselines/h200-stats.json --subset 2>&1 | tail -8
echo "all done at $(( $(date +%s)-s )) s"
