#!/usr/bin/env bash
# Session 34, run v135: v134's pip build (carried, .carry/site.txz, outside git): what the one-row
# and four-row decode_partial kernels execute, the register kernels (SDPA_MATH_SM90=0) against
# the bulk-copy ring (results/h200-s34-decode-bulk-ring.diff): instructions, issue activity,
# DRAM throughput, duration (ncu, fp16). (Two earlier tries filtered on `decode_partial` and
# profiled nothing; this is the form that ran.)
export PYTHONPATH=/tmp/s/site; [ -d /tmp/s/site ] || (mkdir -p /tmp/s && tar -xJf .carry/site.txz -C /tmp/s)
M=gpu__time_duration.sum,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
for shape in decode_s2k_d128 decode_s32k_d128_gqa; do for mode in reg bulk; do
  echo "== $shape $mode"
  if [ $mode = reg ]; then export SDPA_MATH_SM90=0; else unset SDPA_MATH_SM90; fi
  timeout 100 ncu --clock-control none --kernel-name regex:decode_ --launch-skip 4 --launch-count 2 --metrics $M \
    python3 tests/gpu/forward_times.py one $shape float16 2>&1 | grep -vE "^==PROF==|^ *$|^ +-+" | cut -c1-140 | head -30
done; done 2>&1 | tee $OUT/results.txt
