#!/usr/bin/env bash
# session 32, run v125: branch persist2 (persistent CTAs as kernels of their own, taken by the
# unmasked non-causal forward with more row blocks than SMs) built the user's way (pip on the
# H200) in the background; meanwhile the GPU tests on its carried build (site_p2) and
# forward_times of main (site_m32) against it, interleaved. Then the pip build's tests, the three
# sanitizers on it, and the pip build back for the harness (v126).
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v125.txz -C /tmp/s
s=$(date +%s); (CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 300 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc) &
echo "== carried persist2 tests"
(cd tests/python && PYTHONPATH=/tmp/s/site_p2 timeout 150 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_sass.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
for round in 1 2; do
  for s in site_m32 site_p2; do echo "== $s float16 r$round"; PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/forward_times.py float16 | cut -c1-40; done
done
wait; cat /tmp/build.rc; tail -3 /tmp/build.log > $OUT/build-tail.log
export PYTHONPATH=/tmp/site
echo "== pip build tests"
(cd tests/python && timeout 170 python3 -m pytest -q -p no:cacheprovider test_build.py test_cuda_sm90.py test_nonfinite.py test_sass.py test_cuda_sm90_stats.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -10)
for tool in memcheck racecheck synccheck; do
  ( timeout 120 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
(cd /tmp && tar -cf - site | xz -6 -T16 > $OUT/site_pip.txz); ls -la $OUT
} 2>&1 | tee $OUT/results.txt
