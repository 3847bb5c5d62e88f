#!/usr/bin/env bash
# session 24, run v81: rows alone with the causal mask on the keys right of the window's first row only; a baddbmm out_dtype probe
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/s && tar -xJf .carry/pack/s24r.tar.xz -C /tmp/s && export PYTHONPATH=/tmp/s/s24r
{
echo "== tests"; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_sm90_stats.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -20
echo "== probe"; python3 .carry/baddbmm_probe.py 2>&1 | tail -2
echo "== stats"; timeout 200 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json 2>&1 | tail -6
grep -E "^\| [a-z0-9_]+ \| (float16|bfloat16) \| yes" $OUT/stats.md | cut -d'|' -f2-13
echo "== rows64 long4k profile"; python3 .carry/rows_prof.py 2>&1 | grep -vE "^ +(Activity|cuda[A-Z])" | tail -14 | cut -c1-75,150-175
} 2>&1 | tee $OUT/results.txt
