#!/usr/bin/env bash
# session 27, run v100 (final): the tree of branch keypad-skip (s26 + softmax_rows' register form +
# the padded-tile skip). The package builds the user's way (pip, this machine's compilers) while
# the carried build of the same tree runs the padded-tile tests, the forward times and the
# anchors+variants harness (fp16, bf16, gated); then on the pip build: the statistics rows (gated),
# the GPU tests, a fuzz and the three sanitizers.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
( rm -rf /tmp/site; s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=10 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc ) &
mkdir -p /tmp/s && tar -xJf .carry/pack/v100.txz -C /tmp/s
( export PYTHONPATH=/tmp/s/site27f
  echo "== padded-tile and mask tests, carried ($(date +%T))"
  (cd tests/python && timeout 100 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py -k "padded or masked" 2>&1 | grep -E "FAILED|passed|failed" | head -8)
  echo "== forward_times ($(date +%T))"
  python3 tests/gpu/forward_times.py float16 2>&1 | head -9
  echo "== bench, carried ($(date +%T))"
  timeout 240 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
  python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -8
  grep -E "kpad|fmask" $OUT/bench.md | head -8 )
wait
cat /tmp/build.rc; tail -2 /tmp/build.log; cp /tmp/build.log $OUT/build.log
export PYTHONPATH=/tmp/site
echo "== stats, pip build ($(date +%T))"
timeout 120 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json --subset 2>&1 | tail -6
for tool in memcheck racecheck synccheck; do
  ( timeout 200 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
echo "== tests, pip build ($(date +%T))"
(cd tests/python && timeout 180 python3 -m pytest -q -p no:cacheprovider test_softmax_rows.py test_cuda_sm90.py test_nonfinite.py test_build.py test_sass.py test_cuda_sm90_stats.py test_stats.py -k "cuda or sm90 or sass or rows or softmax or build" 2>&1 | grep -E "FAILED|passed|failed|rror" | head -10)
SDPA_MATH_FUZZ_PROBLEMS=120 timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | grep -E "fuzz|passed|failed" | tail -2
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool (pip build)"; cat /tmp/san-$tool.log; done
echo "== end $(date +%T)"
} 2>&1 | tee $OUT/results.txt
