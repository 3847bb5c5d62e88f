#!/usr/bin/env bash
# Session 33, run v130: decode_finalize with its loads issued together (site_fin) and, on top of
# it, an L2 prefetch by prefetch.global.L2 lines in decode_partial (site_pl2), against main
# (site_main), builds carried from the dev machine (.carry/pack/v130.txz, outside git). Two
# interleaved rounds of kernel_times on the decode shapes and forward_times (every row); the GPU
# tests on both branches' builds. One results file (the tool returns a few files only).
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v130.txz -C /tmp/s
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for round in 1 2; do
  for b in main fin pl2; do
    echo "== round $round $b"
    PYTHONPATH=/tmp/s/site_$b timeout 60 python3 tests/gpu/kernel_times.py float16 decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | grep -v -i warn
    PYTHONPATH=/tmp/s/site_$b timeout 120 python3 tests/gpu/forward_times.py float16 2>&1 | cut -c1-40
  done
done
for b in fin pl2; do
  echo "== bf16 $b"
  PYTHONPATH=/tmp/s/site_$b timeout 60 python3 tests/gpu/kernel_times.py bfloat16 decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | grep -v -i warn
  echo "== tests on site_$b"
  PYTHONPATH=/tmp/s/site_$b timeout 150 python3 -m pytest -q -x tests/python/test_cuda.py tests/python/test_fuzz.py tests/python/test_nonfinite.py -k "not cpu" -p no:cacheprovider 2>&1 | tail -2
done
} 2>&1 | tee $OUT/results.txt
