#!/usr/bin/env bash
# Session 34, run v134: the decode forward's K and V rows through a shared-memory ring filled by
# bulk copies (decode_partial's BULK kernels, sm_90+), main + this change built on the H200 by pip
# as a user builds it; then (1) the CUDA, fuzz and nonfinite tests (the many-blocks decode test's
# Ev 8 and 128 cases and the new row-stride test run on a GPU for the first time); (2) kernel_times
# of the decode shapes, the register kernels (SDPA_MATH_SM90=0) against BULK, interleaved;
# (3) memcheck and racecheck on sanitize_cases.py's decode calls; the build packed for reuse.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 330 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s"
tail -2 /tmp/build.log | cut -c1-200
export PYTHONPATH=/tmp/site
echo "== tests"
(cd tests/python && timeout 170 python3 -m pytest -q -x -p no:cacheprovider test_cuda.py test_fuzz.py test_nonfinite.py -k "not cpu" 2>&1 \
   | grep -E "FAILED|passed|failed|rror" | head -20)
for round in 1 2; do
  for mode in reg bulk; do
    for dt in float16 bfloat16; do
      [ $round = 2 ] && [ $dt = bfloat16 ] && continue
      echo "== round $round $mode $dt"
      if [ $mode = reg ]; then export SDPA_MATH_SM90=0; else unset SDPA_MATH_SM90; fi
      timeout 40 python3 tests/gpu/kernel_times.py $dt decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | grep -v -i warn
    done
  done
done
unset SDPA_MATH_SM90
(cd /tmp && tar -cf - site | xz -T16 -4 > $OUT/site.txz); ls -la $OUT/site.txz
for tool in memcheck racecheck; do
  echo "== $tool decode"
  timeout 50 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py decode > /tmp/san.full 2>&1
  grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -4
  tail -2 /tmp/san.full
done
} 2>&1 | tee $OUT/results.txt
