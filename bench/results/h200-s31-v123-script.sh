#!/usr/bin/env bash
# session 31, run v123: branch copy-shift (every copy store 8 bytes and aligned) against
# odd-pairs, carried builds: the sm90 and nonfinite tests and memcheck on sanitize_cases with
# copy-shift, then forward_times of both, interleaved, two rounds fp16.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v123.txz -C /tmp/s
( PYTHONPATH=/tmp/s/site_cs timeout 150 compute-sanitizer --tool memcheck --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san.full 2>&1
  { grep -E "^=+ +(Invalid|Error)" /tmp/san.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6; tail -2 /tmp/san.full; } > /tmp/san.log ) &
(cd tests/python && PYTHONPATH=/tmp/s/site_cs timeout 150 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_sass.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
wait; echo "-- memcheck"; cat /tmp/san.log
for round in 1 2; do
  for s in site_op site_cs; do echo "== $s float16 r$round"; PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/forward_times.py float16 | cut -c1-40; done
done
} 2>&1 | tee $OUT/results.txt
