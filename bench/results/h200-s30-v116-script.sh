#!/usr/bin/env bash
# session 30, run v116: the landing tree (P staged for every forward; the warpgroup's copy in
# kernels of their own for rows TMA cannot store) built the user's way (pip on the H200, the
# machine's compilers). While it builds: the GPU tests on the same tree's carried build (site_t).
# Then memcheck, racecheck and synccheck on sanitize_cases (pip build), forward times of main's
# kernels (site_v2) and the pip build, the harness (anchors+variants, fp16 + bf16) gated against
# h200.json.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v116.txz -C /tmp/s
s=$(date +%s); (CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 260 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc) &
(cd tests/python && PYTHONPATH=/tmp/s/site_t timeout 200 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_cuda_sm90_stats.py test_cuda_sm90_backward.py test_sass.py 2>&1 | grep -E "FAILED|passed|failed" | head -20)
wait; cat /tmp/build.rc; tail -3 /tmp/build.log > $OUT/build-tail.log
export PYTHONPATH=/tmp/site
for tool in memcheck racecheck synccheck; do
  ( timeout 110 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
for s in /tmp/s/site_v2 /tmp/site; do echo "== $s float16"; PYTHONPATH=$s timeout 30 python3 tests/gpu/forward_times.py float16 | cut -c1-40; done
timeout 190 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -14
} 2>&1 | tee $OUT/results.txt
