#!/usr/bin/env bash
# Session 33, run v131: main 28e142d (decode_finalize's loads issued together) built on the H200
# by pip as a user builds it, in the background; meanwhile, on the carried build of the same
# decode.cu (site_fin, .carry/pack/v130.txz): Nsight Compute of the two decode kernels
# (decode_s2k_d128 and decode_s32k_d128_gqa: what limits decode_partial and decode_finalize),
# then memcheck, synccheck and racecheck on sanitize_cases.py (its padding float-mask case has not
# run under them yet). After the build: its tests (build, CUDA with the new many-blocks decode
# test, fuzz, nonfinite, SASS), forward_times and kernel_times on it.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v130.txz -C /tmp/s
s=$(date +%s); (CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 330 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc) &
for shape in decode_s2k_d128 decode_s32k_d128_gqa; do
  echo "== ncu $shape (site_fin)"
  PYTHONPATH=/tmp/s/site_fin timeout 120 ncu --clock-control none --kernel-name regex:decode_ --launch-skip 4 --launch-count 2 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats -o /tmp/rep-$shape python3 tests/gpu/forward_times.py one $shape float16 > /tmp/ncu.log 2>&1
  tail -1 /tmp/ncu.log
  ncu --import /tmp/rep-$shape.ncu-rep 2>&1 | grep -vE "^ +-+ +-+ +-+$|^ *$|OPT |INF |^ +(See|This|or|the|and|Check|Consider|memory|of|on|in|to|for|is) " | cut -c1-150
done
for tool in memcheck synccheck racecheck; do
  echo "== $tool (site_fin)"
  PYTHONPATH=/tmp/s/site_fin timeout 140 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san.full 2>&1
  grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -4
  tail -2 /tmp/san.full
done
wait; cat /tmp/build.rc; tail -3 /tmp/build.log
export PYTHONPATH=/tmp/site
echo "== pip build tests"
(cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider test_build.py test_cuda.py test_fuzz.py test_nonfinite.py test_sass.py \
   -k "not wheel and not cpu" 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
echo "== pip build forward_times fp16"
timeout 60 python3 tests/gpu/forward_times.py float16 | cut -c1-40
timeout 60 python3 tests/gpu/kernel_times.py float16 decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | grep -v -i warn
} 2>&1 | tee $OUT/results.txt
