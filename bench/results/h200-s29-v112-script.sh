#!/usr/bin/env bash
# session 29, run v112: the landing tree (mask plan, second form) built the user's way (pip on
# the H200, the machine's default compilers), its GPU tests, each kernel's time per mask against
# the carried main build (fmask_bhls: a per-head float mask, read a third time by the plan), then
# racecheck and synccheck on sanitize_cases (memcheck ran on the same code in v111).
set -uo pipefail
export PYTHONUNBUFFERED=1
{
s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 260 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s"
tail -3 /tmp/build.log
mkdir -p /tmp/s && tar -xJf .carry/pack/v112.txz -C /tmp/s
(cd tests/python && PYTHONPATH=/tmp/site timeout 80 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_sass.py test_build.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
PYTHONPATH=/tmp/s/site_main timeout 40 python3 tests/gpu/mask_ab.py kernels main float16 2>&1 | grep -v -i warn
PYTHONPATH=/tmp/site timeout 40 python3 tests/gpu/mask_ab.py kernels pip float16 2>&1 | grep -v -i warn
for tool in racecheck synccheck; do
  ( PYTHONPATH=/tmp/site timeout 90 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
wait
for tool in racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
} 2>&1 | tee $OUT/results.txt
