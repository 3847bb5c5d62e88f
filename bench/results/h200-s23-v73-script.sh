#!/usr/bin/env bash
# session 23 experiment: backward KL stages (a) and chunked block order (b; SDPA_MATH_EXP_NOCHUNK=1 = old order)
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/s && for v in a b; do tar -xJf .carry/pack/site23$v.tar.xz -C /tmp/s; done
R=$OUT/results.txt
{
for v in a b; do
  export PYTHONPATH=/tmp/s/site23$v
  echo "== tests $v"; python3 -m pytest -q -p no:cacheprovider tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py 2>&1 | tail -2
done
for round in 1 2; do
for cfg in "a" "b" "b NOCHUNK"; do
  set -- $cfg; export PYTHONPATH=/tmp/s/site23$1
  if [ $# -gt 1 ]; then export SDPA_MATH_EXP_NOCHUNK=1; else unset SDPA_MATH_EXP_NOCHUNK; fi
  for shape in prefill1k_d128 prefill1k_d64 gqa1k_d128 long4k_d128_causal; do
    echo "[$cfg r$round] $(python3 tests/gpu/kl_profile.py $shape float16 2>/dev/null | head -1)"
  done
done
done
for cfg in "b" "b NOCHUNK"; do
  set -- $cfg; export PYTHONPATH=/tmp/s/site23$1
  if [ $# -gt 1 ]; then export SDPA_MATH_EXP_NOCHUNK=1; else unset SDPA_MATH_EXP_NOCHUNK; fi
  echo "== backward_times [$cfg]"; python3 tests/gpu/backward_times.py float16 2>&1 | tail -8
done
unset SDPA_MATH_EXP_NOCHUNK; export PYTHONPATH=/tmp/s/site23b
echo "== ncu b"
timeout 200 ncu --clock-control none --kernel-name regex:'kl_rows_prep|backward_sm90|dq_from' --launch-skip 6 --launch-count 3 \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,sm__throughput.avg.pct_of_peak_sustained_elapsed' \
  python3 tests/gpu/kl_profile.py prefill1k_d128 float16 2>&1 | grep -E "sm90|kl_rows|dq_from|duration|dram__|hit_rate|warps_active|grid_size|sm__throughput|stalled" | awk '$NF+0 >= 0.1 || /[a-z]_[a-z]+</' | cut -c1-130
} 2>&1 | tee $R
