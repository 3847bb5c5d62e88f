#!/usr/bin/env bash
# session 25, run v88: P double-buffered in shared memory. a = main, b = d64 double buffer,
# c = b + d128 double buffer with 2 K stages, d = c + the pipelined pass 2 (step 44). Carried builds.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
mkdir -p /tmp/s && for x in site25 site25b site25c site25d; do tar -xJf .carry/pack/$x.tar.xz -C /tmp/s & done; wait
for round in 1 2; do for b in site25 site25b site25c site25d; do
  echo "== forward_times $b round $round"; PYTHONPATH=/tmp/s/$b python3 tests/gpu/forward_times.py float16 2>&1 | head -8 | cut -c1-40
done; done
for b in site25c site25d; do
  ( PYTHONPATH=/tmp/s/$b timeout 250 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_sm90.py tests/python/test_nonfinite.py tests/python/test_cuda_sm90_stats.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -8 > /tmp/t-$b.log
    PYTHONPATH=/tmp/s/$b SDPA_MATH_FUZZ_PROBLEMS=200 timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | grep -E "fuzz|passed|failed" | tail -2 >> /tmp/t-$b.log ) &
done
( PYTHONPATH=/tmp/s/site25c timeout 250 compute-sanitizer --tool racecheck --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/rc.full 2>&1; grep -E "^=+ +(Race|Error)|SUMMARY" /tmp/rc.full | sort | uniq -c | head > /tmp/rc.log ) &
wait
for b in site25c site25d; do echo "== tests $b"; cat /tmp/t-$b.log; done
echo "== racecheck site25c"; cat /tmp/rc.log
} 2>&1 | tee $R
