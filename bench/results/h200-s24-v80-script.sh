#!/usr/bin/env bash
# session 24, run v80: rows alone (softmax of the window's fp32 logits) only where the window is at most a quarter of the rows or L <= 4 (carried build of 153e96b + stats.py change)
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/s && tar -xJf .carry/pack/s24r.tar.xz -C /tmp/s && export PYTHONPATH=/tmp/s/s24r
{
echo "== tests"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_sm90_stats.py tests/python/test_stats.py 2>&1 | grep -E "FAILED|passed|failed|Error|assert" | head -30
echo "== stats"; timeout 200 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -3
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json 2>&1 | tail -12
grep -E "^\| [a-z0-9_]+ \| (float16|bfloat16) \| yes" $OUT/stats.md | cut -d'|' -f2-13
} 2>&1 | tee $OUT/results.txt
echo "== rows64 long4k profile"; python3 .carry/rows_prof.py 2>&1 | tail -16 | cut -c1-160 | tee -a $OUT/results.txt
