#!/usr/bin/env bash
# session 25, run v89 (final): the side-by-side harness (anchors + variants, fp16 and bf16) on the
# carried build of the final tree while the package builds the user's way (pip, this machine's
# compilers); then the GPU tests and the sanitizers on that pip build.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
( rm -rf /tmp/site; s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=12 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc ) &
mkdir -p /tmp/s && tar -xzf .carry/pack/site25f.tgz -C /tmp/s
echo "== bench run (carried build of the final tree)"
( export PYTHONPATH=/tmp/s/site25f
  timeout 330 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -24
  python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -12 )
wait
cat /tmp/build.rc; tail -2 /tmp/build.log; cp /tmp/build.log $OUT/build.log
export PYTHONPATH=/tmp/site
so=$(ls /tmp/site/sdpa_math/_C*.so); echo "NEEDED: $(readelf -d "$so" | grep NEEDED | sed -E 's/.*\[(.*)\]/\1/' | tr '\n' ' ')"
echo "exported C++ runtime symbols: $(nm -D --defined-only "$so" | awk '{print $NF}' | grep -cE '^(__cxa_|_ZSt|_ZNSt|_ZNKSt|_ZNSo)')"
for tool in memcheck racecheck synccheck; do
  ( timeout 200 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
echo "== tests (pip build)"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_sm90.py tests/python/test_nonfinite.py tests/python/test_build.py tests/python/test_sass.py tests/python/test_cuda_sm90_stats.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -10
SDPA_MATH_FUZZ_PROBLEMS=200 timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | grep -E "fuzz|passed|failed" | tail -2
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool (pip build)"; cat /tmp/san-$tool.log; done
} 2>&1 | tee $R
