#!/usr/bin/env bash
# Prepared in session 32 for session 33, run v129: why the bool-mask forward moves by 4-13 % with
# changes that leave its code the same but for register names (NOTES, session 32), and where the
# float mask's changed tile costs. Nsight Compute on carried builds (.carry/pack/v129.txz, outside
# git: site_nf = main dafd5b4, whose bool-mask kernels are byte-identical to 072cd06's; site_p2 =
# branch persist2, bool mask +5 % in v125): +keypad fp16 on both, +fmask bf16 on main. Stall
# samples per reason and per SASS line (source CSV), instruction fetch and L1 figures. Then the
# three sanitizers with sanitize_cases.py on main's build (its padding float-mask case, added after
# v128, has not run yet). About 5 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v129.txz -C /tmp/s
prof() {  # build row dtype tag
  PYTHONPATH=/tmp/s/$1 timeout 120 ncu --clock-control none --kernel-name regex:forward_sm90 --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section InstructionStats \
    --section SchedulerStats --section SourceCounters -o /tmp/rep-$4 python3 tests/gpu/forward_times.py one "$2" $3 > /tmp/ncu-$4.log 2>&1
  tail -1 /tmp/ncu-$4.log
  ncu --import /tmp/rep-$4.ncu-rep > $OUT/ncu-$4.txt 2>&1
  ncu --import /tmp/rep-$4.ncu-rep --page source --csv --print-source sass 2>/dev/null | gzip -9 > $OUT/ncu-$4-source.csv.gz
}
prof site_nf "prefill1k_d128+keypad" float16 keypad-main
prof site_p2 "prefill1k_d128+keypad" float16 keypad-persist2
prof site_nf "prefill1k_d128+fmask" bfloat16 fmask-bf16-main
for tool in memcheck synccheck racecheck; do
  echo "-- $tool"
  PYTHONPATH=/tmp/s/site_nf timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san.full 2>&1
  grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)" /tmp/san.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -4
  tail -2 /tmp/san.full
done
ls -la $OUT
} 2>&1 | tee $OUT/results.txt
