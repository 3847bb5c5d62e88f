#!/usr/bin/env bash
# session 37, run v150: the Hopper backward's delta_rows with 8-byte loads for rows of S % 8 = 4
# and 32-bit index math. pip build as a user does; sm90 backward and CUDA tests; CUDA fuzz;
# memcheck/racecheck over the whole sanitize set; kernel times (delta_rows) of tail100 and the
# prefill rows; the harness (anchors+variants, fp16/bf16) gated against the baseline.
set -uo pipefail
export PYTHONUNBUFFERED=1
s=$(date +%s)
bash scripts/gpu_run.sh none > $OUT/gpu_run.txt 2>&1
tail -2 $OUT/gpu_run.txt; echo "build done at $(( $(date +%s)-s )) s"
export PYTHONPATH=/tmp/site
for tool in memcheck racecheck; do
( timeout 230 compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/sanitize_cases.py 2>&1 | tail -6 > $OUT/san-$tool.log ) &
done
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_sm90_backward.py tests/python/test_cuda.py tests/python/test_cuda_decode_stats.py 2>&1 | tail -3 | tee $OUT/pytest.log
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | tail -1 | tee -a $OUT/pytest.log
{ echo "== float16"; timeout 60 python3 tests/gpu/kernel_times.py float16 tail100_d64 prefill1k_d128 prefill1k_d64 gqa1k_d128 prefill1k_d128_s1020 2>&1 | grep "f+b"; } | tee $OUT/kernel_times.txt
echo "timing done at $(( $(date +%s)-s )) s"
timeout 150 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT/bench 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/bench/bench.json bench/baselines/h200.json --subset 2>&1 | tail -6
wait
for f in $OUT/san-*.log; do echo "$f: $(grep -E 'SUMMARY|finished' $f | tr '\n' ' ')"; done
echo "all done at $(( $(date +%s)-s )) s"
cd $OUT && tar czf results.tgz san-*.log gpu_run.txt build.log build-check.txt machine.txt 2>/dev/null; rm -f san-*.log build.log build-check.txt machine.txt
