#!/usr/bin/env bash
# session 25, run v85: per-instruction stall samples of the forward (normal build, prefill1k_d128 fp16).
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
mkdir -p /tmp/s && tar -xJf .carry/pack/site25.tar.xz -C /tmp/s
export PYTHONPATH=/tmp/s/site25
timeout 200 ncu --clock-control none -k regex:forward_sm90 -s 3 -c 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,smsp__cycles_active.avg,gpu__time_duration.sum' \
  -o $OUT/ncu-fwd python3 tests/gpu/trace_forward.py prefill1k_d128 float16 > $OUT/ncu-run.txt 2>&1
ncu -i $OUT/ncu-fwd.ncu-rep --page details > $OUT/ncu-fwd-details.txt 2>&1
ncu -i $OUT/ncu-fwd.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/ncu-fwd-source.csv.gz
rm -f $OUT/ncu-fwd.ncu-rep
grep -E "Duration|stalled_" $OUT/ncu-fwd-details.txt | cut -c1-120 | head -40
} 2>&1 | tee $R
