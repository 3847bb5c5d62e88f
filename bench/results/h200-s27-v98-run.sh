#!/usr/bin/env bash
# session 27, run v98: softmax_rows' register form (carried build site27): its tests, memcheck and
# racecheck on them, and the stats rows + gate (rows64 on prefill regressed in v97 with the two-read form).
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v98.txz -C /tmp/s && export PYTHONPATH=/tmp/s/site27
echo "== tests ($(date +%T))"
(cd tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider test_softmax_rows.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -10)
for tool in memcheck racecheck; do
  (cd tests/python && timeout 200 compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -p no:cacheprovider test_softmax_rows.py -k cuda > /tmp/san-$tool.full 2>&1; echo "-- $tool"; grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sort | uniq -c | head -4; tail -2 /tmp/san-$tool.full)
done
echo "== stats ($(date +%T))"
timeout 200 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json --subset 2>&1 | tail -6
grep -E "^\| [a-z].*(float16|bfloat16) \| yes" $OUT/stats.md | cut -d'|' -f2,3,6,9,13
echo "== end $(date +%T)"
} 2>&1 | tee $OUT/results.txt
