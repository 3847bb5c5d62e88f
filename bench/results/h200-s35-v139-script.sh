#!/usr/bin/env bash
# Session 35, v139: the tensor-core decode prototype with a prefetching variant (two register
# buffers) and 512/1024-key CTAs (tests/gpu/decode_tc_rate.cu, built here, carried in .carry/).
set -u
mkdir -p "$OUT"
.carry/decode_tc_rate 2>&1 | tee "$OUT/rate.txt"
for n in 3 7; do
  ncu --clock-control none --kernel-name regex:partial_tc --launch-skip 3 --launch-count 1 \
    --metrics gpu__time_duration.sum,smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_issued.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread \
    .carry/decode_tc_rate $n > "$OUT/ncu-$n.txt" 2>&1
  grep -E "partial_tc|duration|inst_executed|dram__|issued|warps_active|registers" "$OUT/ncu-$n.txt" | head -12
done
