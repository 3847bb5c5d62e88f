#!/usr/bin/env bash
# Session 33, run v129: the decode loop's L2 prefetch (branch decode-prefetch) against main, on
# builds carried from the dev machine (.carry/pack/v129.txz, outside git: site_main = main
# 2736e7a, site_pf = the branch). Two interleaved rounds of forward_times (every row: the
# non-decode rows are the control) and kernel_times on the decode shapes (forward and f+b
# kernels); then the branch's GPU tests (test_cuda, test_fuzz, test_nonfinite); an ncu of the bf16
# float-mask row on main (its changed tiles have not been profiled). About 6 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v129.txz -C /tmp/s
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for round in 1 2; do
  for b in main pf; do
    echo "== round $round $b forward_times fp16"
    PYTHONPATH=/tmp/s/site_$b timeout 120 python3 tests/gpu/forward_times.py float16 > $OUT/ft-$b-r$round.txt 2>&1
    grep -E "decode|prefill1k_d128 |tail100" $OUT/ft-$b-r$round.txt
    echo "== round $round $b kernel_times"
    PYTHONPATH=/tmp/s/site_$b timeout 60 python3 tests/gpu/kernel_times.py float16 decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | tee $OUT/kt-$b-r$round.txt
  done
done
PYTHONPATH=/tmp/s/site_pf timeout 60 python3 tests/gpu/kernel_times.py bfloat16 decode_s2k_d128 decode_s32k_d128_gqa 2>&1 | tee $OUT/kt-pf-bf16.txt
echo "== tests on site_pf"
PYTHONPATH=/tmp/s/site_pf timeout 200 python3 -m pytest -q -x tests/python/test_cuda.py tests/python/test_fuzz.py tests/python/test_nonfinite.py -k "not cpu" -p no:cacheprovider 2>&1 | tail -5
echo "== ncu: prefill1k_d128+fmask bf16 on main (the float mask's changed tiles, unprofiled)"
PYTHONPATH=/tmp/s/site_main timeout 120 ncu --clock-control none --kernel-name regex:forward_sm90 --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section InstructionStats --section SchedulerStats --section SourceCounters \
  -o /tmp/rep-fmask python3 tests/gpu/forward_times.py one "prefill1k_d128+fmask" bfloat16 > /tmp/ncu-fmask.log 2>&1
tail -1 /tmp/ncu-fmask.log
ncu --import /tmp/rep-fmask.ncu-rep > $OUT/ncu-fmask-bf16-main.txt 2>&1
ncu --import /tmp/rep-fmask.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip -9 > $OUT/ncu-fmask-bf16-main-source.csv.gz
ls -la $OUT
} 2>&1 | tee $OUT/results.txt
