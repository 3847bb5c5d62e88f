#!/usr/bin/env bash
# session 29, run v110: why the plan build was slower on bool masks (v109). Four carried builds:
# main (8e7dbcc), plan (the review's fix), plan2 (loads predicated off instead of a branch),
# noplan (plan code compiled, no plan built: the warps vote). Each kernel's time per mask
# (torch profiler), forward times (mask_ab, two orders), and the new test on plan.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v110.txz -C /tmp/s
(cd tests/python && PYTHONPATH=/tmp/s/site_plan timeout 120 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py -k "mask_plan or neutral or masked or rounds_to_zero" 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
for s in site_main site_noplan site_plan site_plan2; do PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/mask_ab.py kernels $s float16; done
for s in site_main site_noplan site_plan site_plan2 site_plan2 site_plan site_noplan site_main; do PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/mask_ab.py times $s float16; done
} 2>&1 | tee $OUT/results.txt
