#!/usr/bin/env bash
# Prepared in session 31 for session 32, run v124: branches `persistent` and `o-tma` against main,
# carried builds packed in session 31 (.carry/pack/v124.txz: site_m32 = main 072cd06, site_pers,
# site_otma; rebuild them if the pack is gone). Run with the `persistent` branch checked out (its
# tests and sanitizer case). The sm90 tests on both builds, racecheck and memcheck on
# sanitize_cases with persistent's build (its 144-row-block case runs the persistent loop), then
# forward_times of the three builds interleaved, two rounds fp16.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v124.txz -C /tmp/s
for tool in racecheck memcheck; do
  ( PYTHONPATH=/tmp/s/site_pers timeout 200 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
for s in site_pers site_otma; do
  echo "== $s tests"
  (cd tests/python && PYTHONPATH=/tmp/s/$s timeout 150 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_sass.py test_cuda_sm90_stats.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
done
wait
for tool in racecheck memcheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
for round in 1 2; do
  for s in site_m32 site_pers site_otma; do echo "== $s float16 r$round"; PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/forward_times.py float16 | cut -c1-40; done
done
} 2>&1 | tee $OUT/results.txt
