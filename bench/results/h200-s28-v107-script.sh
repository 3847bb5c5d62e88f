#!/usr/bin/env bash
# session 28, run v107: the final tree (steps 47 + 48 on mask-rows-scan) built the user's way (pip
# on the H200), its GPU tests, an A/B against the carried step-47 build (site28c), the harness
# (anchors+variants, fp16 + bf16) and the statistics rows gated against the baselines, then
# memcheck and synccheck on sanitize_cases.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s"
tail -5 /tmp/build.log > $OUT/build-tail.log
mkdir -p /tmp/s && tar -xJf .carry/pack/v107.txz -C /tmp/s
export PYTHONPATH=/tmp/site
for tool in memcheck synccheck; do
  ( timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -6
      tail -2 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
(cd tests/python && timeout 120 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_cuda_sm90_stats.py test_softmax_rows.py test_build.py test_sass.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -10)
wait
for s in site28c site; do PYTHONPATH=/tmp/s/$s:/tmp/$s python3 tests/gpu/mask_ab.py times $s; done
timeout 190 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -12
timeout 110 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json --subset 2>&1 | tail -6
for tool in memcheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
} 2>&1 | tee $OUT/results.txt
