#!/usr/bin/env bash
# session 24, run v76: carried builds of main (6ca7dce), bsa (shared-access element pass), krh (row helper), both
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/s && for v in main bsa krh both; do tar -xJf .carry/pack/s24$v.tar.xz -C /tmp/s & done; wait
R=$OUT/results.txt
T="tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py tests/python/test_stats.py"
{
export PYTHONPATH=/tmp/s/s24both
for tool in memcheck racecheck synccheck; do
  ( timeout 230 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py kl > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)|at .*sdpa_math" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -8
      tail -3 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
echo "== tests both"; timeout 200 python3 -m pytest -q -x -p no:cacheprovider $T 2>&1 | tail -3
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
for v in bsa krh; do
  export PYTHONPATH=/tmp/s/s24$v; echo "== tests $v"; timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py 2>&1 | tail -2
done
for round in 1 2; do
  for v in main bsa krh both; do
    export PYTHONPATH=/tmp/s/s24$v
    for shape in prefill1k_d128 long4k_d128_causal; do
      [ $round = 2 ] && [ $shape = long4k_d128_causal ] && continue
      echo "[$v r$round] $(python3 tests/gpu/kl_profile.py $shape float16 2>/dev/null | head -1)"
    done
  done
done
for v in main both; do
  export PYTHONPATH=/tmp/s/s24$v; echo "== backward_times [$v]"; python3 tests/gpu/backward_times.py float16 2>&1 | tail -8
done
export PYTHONPATH=/tmp/s/s24both
python3 tests/gpu/kl_profile.py prefill1k_d128 float16 > $OUT/kl-profile-both.txt 2>&1
echo "== ncu both"
timeout 150 ncu --clock-control none --kernel-name regex:'kl_forward_sm90|backward_sm90' --launch-skip 4 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,smsp__cycles_active.avg,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum' \
  -o $OUT/ncu-kl python3 tests/gpu/kl_profile.py prefill1k_d128 float16 > $OUT/ncu-kl-run.txt 2>&1
ncu -i $OUT/ncu-kl.ncu-rep --page details > $OUT/ncu-kl-details.txt 2>&1
ncu -i $OUT/ncu-kl.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/ncu-kl-source.csv.gz
grep -E "sm90<|Duration|DRAM Throughput|hmma|Issued Warp|stalled_(long|wait|barrier|no_inst|short|math|mio|lg)" $OUT/ncu-kl-details.txt | cut -c1-120
zcat $OUT/ncu-kl-source.csv.gz | head -3 | cut -c1-300
} 2>&1 | tee $R
