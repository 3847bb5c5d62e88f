#!/usr/bin/env bash
# session 25, run v90: the side-by-side harness on the package built the user's way (pip, this
# machine's compilers), the final tree; gated against the H200 baseline.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
rm -rf /tmp/site; s=$(date +%s)
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s"
export PYTHONPATH=/tmp/site
timeout 250 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -22
python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -12
} 2>&1 | tee $R
