#!/usr/bin/env bash
# Session 33, run v132: the decode forward's four-row kernels without mask branches at 4 CTAs per
# SM (launch bounds; 128 registers, no spill) instead of 3 (135 registers), site_lb, against
# site_fin (main 28e142d's decode.cu), carried builds (.carry/pack/v132.txz). Two interleaved
# rounds of kernel_times on the decode shapes, fp16 and bf16; the branch's CUDA tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v132.txz -C /tmp/s
for round in 1 2; do
  for b in fin lb; do
    for dt in float16 bfloat16; do
      echo "== round $round $b $dt"
      PYTHONPATH=/tmp/s/site_$b timeout 60 python3 tests/gpu/kernel_times.py $dt decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | grep -v -i warn
    done
  done
done
echo "== tests on site_lb"
PYTHONPATH=/tmp/s/site_lb timeout 150 python3 -m pytest -q -x tests/python/test_cuda.py tests/python/test_fuzz.py tests/python/test_nonfinite.py -k "not cpu" -p no:cacheprovider 2>&1 | tail -2
} 2>&1 | tee $OUT/results.txt
