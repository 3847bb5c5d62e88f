#!/usr/bin/env bash
# Session 34, run v136: v134's carried build with SDPA_MATH_SM90=0, so the decode forward runs
# its register kernels (the code that landed; the bulk-copy ring did not): the new row-stride
# test and the many-blocks test, then memcheck and racecheck on sanitize_cases.py's decode calls.
export PYTHONPATH=/tmp/s/site SDPA_MATH_SM90=0; [ -d /tmp/s/site ] || (mkdir -p /tmp/s && tar -xJf .carry/site.txz -C /tmp/s)
{ echo "== register path (SDPA_MATH_SM90=0): row-stride and many-blocks decode tests"
  (cd tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider test_cuda.py -k "row_stride or many_key_blocks" 2>&1 | tail -2)
  for tool in memcheck racecheck; do
    echo "== $tool decode (register path)"
    timeout 80 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py decode > /tmp/san.full 2>&1
    grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -4
    tail -2 /tmp/san.full
  done; } 2>&1 | tee $OUT/results.txt
