#!/usr/bin/env bash
# session 31, run v119: branch s31 (main + fmask-prefetch + odd-s) on the H200.
# The package built the user's way (pip on the H200, the machine's compilers) in the background;
# meanwhile the GPU tests on the carried build of the same tree (site_s31) and forward_times of
# main's kernels (site_m31) against s31's, interleaved. Then the pip build's tests and the three
# sanitizers on it; the pip build comes back for the harness in the next call.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v119.txz -C /tmp/s
s=$(date +%s); (CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 300 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc) &
echo "== carried s31 tests"
(cd tests/python && PYTHONPATH=/tmp/s/site_s31 timeout 220 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_sass.py test_cuda_sm90_stats.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
for round in 1 2; do
  for s in site_m31 site_s31; do echo "== $s float16 r$round"; PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/forward_times.py float16 | cut -c1-60; done
done
for s in site_m31 site_s31; do echo "== $s bfloat16"; PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/forward_times.py bfloat16 | cut -c1-60; done
wait; cat /tmp/build.rc; tail -3 /tmp/build.log > $OUT/build-tail.log
export PYTHONPATH=/tmp/site
for tool in memcheck racecheck synccheck; do
  ( timeout 120 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
echo "== pip build tests"
(cd tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider test_build.py test_cuda_sm90.py test_sass.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -10)
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
(cd /tmp && tar -cf - site | xz -6 -T16 > $OUT/site_pip.txz); ls -la $OUT
} 2>&1 | tee $OUT/results.txt
