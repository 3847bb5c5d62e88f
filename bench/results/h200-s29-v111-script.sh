#!/usr/bin/env bash
# session 29, run v111: the plan's second form (float masks always planned, no vote code in their
# kernels, the plan offset in shared memory; bool kernels as main) against main, carried builds
# site_v2 / site_main: GPU tests, each kernel's time per mask, forward times (fp16, bf16), the
# harness's variant rows (forward only) gated against h200.json, memcheck on sanitize_cases.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v111.txz -C /tmp/s
(cd tests/python && PYTHONPATH=/tmp/s/site_v2 timeout 150 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_cuda_sm90_stats.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
for s in site_main site_v2; do PYTHONPATH=/tmp/s/$s timeout 40 python3 tests/gpu/mask_ab.py kernels $s float16 2>&1 | grep -v -i warn; done
for s in site_main site_v2 site_v2 site_main; do PYTHONPATH=/tmp/s/$s timeout 30 python3 tests/gpu/mask_ab.py times $s float16; done
for s in site_main site_v2; do PYTHONPATH=/tmp/s/$s timeout 30 python3 tests/gpu/mask_ab.py times $s bfloat16; done
PYTHONPATH=/tmp/s/site_v2 timeout 100 python3 -m sdpa_math.bench run --device cuda --set variants --dtypes float16 bfloat16 --no-backward --out $OUT 2>&1 | tail -1
PYTHONPATH=/tmp/s/site_v2 python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -14
PYTHONPATH=/tmp/s/site_v2 timeout 100 compute-sanitizer --tool memcheck --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san.full 2>&1
grep -E "^=+ +(Invalid|Error)" /tmp/san.full | sort | uniq -c | head -5; tail -2 /tmp/san.full
} 2>&1 | tee $OUT/results.txt
