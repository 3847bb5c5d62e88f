#!/usr/bin/env bash
# session 25, run v84: the SM's exp rate (MUFU against an FMA polynomial), and the forward's pipe use.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
echo "== mufu_rate"; ./.carry/mufu_rate
mkdir -p /tmp/s && tar -xJf .carry/pack/site25.tar.xz -C /tmp/s
echo "== ncu pipes, forward prefill1k_d128 fp16 (normal build)"
PYTHONPATH=/tmp/s/site25 timeout 200 ncu --clock-control none -k regex:forward_sm90 -s 3 -c 1 \
  --metrics regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,sm__cycles_elapsed.avg,gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
  python3 tests/gpu/trace_forward.py prefill1k_d128 float16 2>&1 | grep -vE "^==PROF==|n/a|  0$|0\.00$" | tail -60
} 2>&1 | tee $R
