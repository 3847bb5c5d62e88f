#!/usr/bin/env bash
# session 29, run v109: branch mask-plan (carried build, site_plan) and main 8e7dbcc (site_main):
# the plan build's GPU tests (incl. session 28's untested tiny-scale test and the new
# test_sm90_mask_plan), an A/B of the masks (fp16, bf16; two rounds, order swapped), then
# memcheck, racecheck and synccheck on sanitize_cases with the plan build.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v109.txz -C /tmp/s
export PYTHONPATH=/tmp/s/site_plan
(cd tests/python && timeout 220 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_cuda_sm90_stats.py test_softmax_rows.py test_sass.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
for dt in float16 bfloat16; do
  for s in site_main site_plan site_plan site_main; do PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/mask_ab.py times $s $dt; done
done
for tool in memcheck racecheck synccheck; do
  ( timeout 240 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -8
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
} 2>&1 | tee $OUT/results.txt
