#!/usr/bin/env bash
# session 28, run v108: ncu of the final forward (branch s28, carried build site28e) under no mask
# and the float mask (fp16, bf16): where the float mask's remaining 1.29x / 1.37x goes.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v108.txz -C /tmp/s
export PYTHONPATH=/tmp/s/site28e
for c in "none float16" "fmask float16" "fmask bfloat16"; do
  set -- $c
  timeout 70 ncu --clock-control none --kernel-name regex:forward_sm90 --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --print-details all \
    python3 tests/gpu/mask_ab.py one $1 $2 > $OUT/ncu-$1-$2.txt 2>&1
  echo "ncu $1 $2 rc=$?"; grep -E "Duration|Executed Instructions |Issue Slots Busy|Stall Long Scoreboard|Stall Wait|Stall Math|Stall Barrier|Stall Not Selected|Stall Short" $OUT/ncu-$1-$2.txt | head -12
done
} 2>&1 | tee $OUT/results.txt
