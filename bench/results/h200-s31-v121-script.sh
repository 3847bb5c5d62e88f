#!/usr/bin/env bash
# session 31, run v121: the harness (anchors+variants, fp16 + bf16) and the statistics rows on the
# package pip built on the H200 in v120 (branch odd-pairs), gated against the baselines.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
tar -xJf .carry/pack/site_pip_v120.txz -C /tmp
export PYTHONPATH=/tmp/site
timeout 200 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -14
timeout 130 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json --subset 2>&1 | tail -6
} 2>&1 | tee $OUT/results.txt
