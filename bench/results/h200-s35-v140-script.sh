#!/usr/bin/env bash
# Session 35, v140: decode_partial_tc in the package. The pip build as a user makes it, then
# test_cuda.py (with the new tensor-core decode tests) and the CUDA fuzz; kernel times of the
# decode rows with the tensor-core partial kernel off (SDPA_MATH_DECODE_TC=0) and on; memcheck
# and racecheck on sanitize_cases.py's decode calls.
set -u
mkdir -p "$OUT"
SDPA_MATH_PYTEST_ARGS="tests/python/test_cuda.py tests/python/test_fuzz.py -k cuda" bash scripts/gpu_run.sh tests 2>&1 | tail -8
export PYTHONPATH=/tmp/site
{ for dt in float16 bfloat16; do
    for tc in 0 1; do
      echo "== $dt SDPA_MATH_DECODE_TC=$tc"
      SDPA_MATH_DECODE_TC=$tc python3 tests/gpu/kernel_times.py $dt decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | tail -12
    done
  done; } > "$OUT/kernel-times.txt" 2>&1
cat "$OUT/kernel-times.txt"
for tool in memcheck racecheck; do
  echo "== $tool decode"
  timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py decode > /tmp/san.full 2>&1
  grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -4
  tail -2 /tmp/san.full
done 2>&1 | tee "$OUT/sanitize.txt"
