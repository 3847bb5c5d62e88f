#!/usr/bin/env bash
# session 25, run v91: the final tree's carried build: kl/backward/stats tests and bench stats with its gate.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
mkdir -p /tmp/s && tar -xzf .carry/pack/site25f.tgz -C /tmp/s && export PYTHONPATH=/tmp/s/site25f
echo "== tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py tests/python/test_stats.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -10
echo "== stats"; timeout 200 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -2
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json 2>&1 | tail -4
} 2>&1 | tee $R
