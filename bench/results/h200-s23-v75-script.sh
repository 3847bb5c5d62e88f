#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p /tmp/s && tar -xJf .carry/pack/site23d.tar.xz -C /tmp/s && export PYTHONPATH=/tmp/s/site23d
{
for tool in memcheck racecheck synccheck; do
  ( timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py kl > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)|at .*sdpa_math" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-200 | head -8
      tail -3 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
echo "== tests"; timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py tests/python/test_stats.py 2>&1 | tail -4
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
for spec in prefill1k_d128:float16 prefill1k_d128:bfloat16 long4k_d128_causal:float16; do
  python3 tests/gpu/kl_profile.py ${spec%%:*} ${spec##*:} > /tmp/prof.txt 2>&1; head -1 /tmp/prof.txt
  grep -E "sm90|Memset" /tmp/prof.txt | cut -c1-60,100-175
done
} 2>&1 | tee $OUT/results-v75.txt
