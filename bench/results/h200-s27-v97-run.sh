#!/usr/bin/env bash
# session 27, run v97: branch s26's tree (step 46 on head 128, softmax_rows). Carried build: tests,
# forward times, stats rows + gate, while the package builds the user's way (pip, this machine's
# compilers); then the GPU tests and the three sanitizers on that pip build.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
( rm -rf /tmp/site; s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=10 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc ) &
mkdir -p /tmp/s && tar -xJf .carry/pack/v97.txz -C /tmp/s
( export PYTHONPATH=/tmp/s/site26c
  echo "== tests, carried ($(date +%T))"
  (cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider test_softmax_rows.py test_cuda_sm90.py test_nonfinite.py test_sass.py test_stats.py test_cuda_sm90_stats.py -k "cuda or sm90 or sass or rows or softmax" 2>&1 | grep -E "FAILED|passed|failed|Error" | head -20)
  echo "== forward_times ($(date +%T))"
  python3 tests/gpu/forward_times.py float16 2>&1 | head -9
  echo "== stats ($(date +%T))"
  timeout 200 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 --out $OUT 2>&1 | tail -2
  python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json --subset 2>&1 | tail -6
  grep -E "long4k|prefill1k_d128 " $OUT/stats.md | head -6 )
wait
cat /tmp/build.rc; tail -2 /tmp/build.log; cp /tmp/build.log $OUT/build.log
export PYTHONPATH=/tmp/site
for tool in memcheck racecheck synccheck; do
  ( timeout 220 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
echo "== tests (pip build, $(date +%T))"
(cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider test_softmax_rows.py test_cuda_sm90.py test_nonfinite.py test_build.py test_sass.py test_cuda_sm90_stats.py test_stats.py -k "cuda or sm90 or sass or rows or softmax or build" 2>&1 | grep -E "FAILED|passed|failed|Error" | head -10)
SDPA_MATH_FUZZ_PROBLEMS=150 timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | grep -E "fuzz|passed|failed" | tail -2
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool (pip build)"; cat /tmp/san-$tool.log; done
echo "== end $(date +%T)"
} 2>&1 | tee $OUT/results.txt
