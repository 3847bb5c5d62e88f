#!/usr/bin/env bash
# Session 33, run v133: main e77540c (decode_finalize's loads together; the four-row decode
# kernels without mask branches at 4 CTAs per SM) built on the H200 by pip as a user builds it;
# its tests (build, CUDA with the many-blocks decode test, fuzz, nonfinite, SASS), forward_times
# and kernel_times on the decode shapes, fp16 and bf16.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 330 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s"
tail -2 /tmp/build.log
export PYTHONPATH=/tmp/site
echo "== pip build tests"
(cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider test_build.py test_cuda.py test_fuzz.py test_nonfinite.py test_sass.py \
   -k "not wheel and not cpu" 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
echo "== pip build forward_times fp16"
timeout 60 python3 tests/gpu/forward_times.py float16 | cut -c1-40
for dt in float16 bfloat16; do timeout 60 python3 tests/gpu/kernel_times.py $dt decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | grep -v -i warn; done
} 2>&1 | tee $OUT/results.txt
