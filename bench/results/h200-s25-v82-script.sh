#!/usr/bin/env bash
# session 25, run v82: carried build of main (29fb4f9's kernels) + the baddbmm rows step.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
mkdir -p /tmp/s && tar -xJf .carry/pack/site25.tar.xz -C /tmp/s && export PYTHONPATH=/tmp/s/site25
for tool in memcheck racecheck synccheck; do
  for set in kl all; do
    ( arg=; [ $set = kl ] && arg=kl
      timeout 280 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py $arg > /tmp/san-$tool-$set.full 2>&1
      { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)|at .*sdpa_math" /tmp/san-$tool-$set.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-300 | head -12
        tail -3 /tmp/san-$tool-$set.full; } > /tmp/san-$tool-$set.log ) &
  done
done
echo "== tests carried"; timeout 300 python3 -m pytest -q -p no:cacheprovider tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py tests/python/test_stats.py tests/python/test_cuda_sm90_stats.py tests/python/test_cuda_sm90.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -20
wait
for tool in memcheck racecheck synccheck; do for set in kl all; do echo "-- $tool $set"; cat /tmp/san-$tool-$set.log; done; done
echo "== stats"; timeout 200 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -3
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json 2>&1 | tail -8
grep -E "rows64|long4k" $OUT/stats.md | head -20
} 2>&1 | tee $R
