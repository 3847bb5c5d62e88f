#!/usr/bin/env bash
# session 31, run v122: Nsight Compute on the pip build of v120 (branch odd-pairs): the unmasked
# head-128 forward on prefill1k_d128 (the issue-12 miss) and the copy kernels on S = 1020 and
# S = 1023 (the odd-pairs prediction miss). Sections for pipes, stalls and memory, and the stall
# samples of every SASS instruction of the S = 1024 kernel.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
tar -xJf .carry/pack/site_pip_v120.txz -C /tmp
export PYTHONPATH=/tmp/site
for shape in prefill1k_d128 prefill1k_d128_s1020 prefill1k_d128_s1023; do
  timeout 100 ncu --clock-control none --kernel-name regex:forward_sm90 --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section InstructionStats --section LaunchStats --section Occupancy --section SourceCounters \
    -o /tmp/rep-$shape python3 tests/gpu/forward_times.py one $shape > /tmp/ncu-$shape.log 2>&1
  tail -2 /tmp/ncu-$shape.log
  ncu --import /tmp/rep-$shape.ncu-rep > $OUT/ncu-$shape.txt 2>&1
done
ncu --import /tmp/rep-prefill1k_d128.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip -9 > $OUT/ncu-prefill1k_d128-source.csv.gz
ls -la $OUT
} 2>&1 | tee $OUT/results.txt
