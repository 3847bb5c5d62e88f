#!/usr/bin/env bash
# session 27, run v99: padded key tiles skipped under bool masks (carried build site27k): the sm90
# tests (the new padded-tiles test included), forward times, and the anchors+variants harness in
# fp16 gated against the H200 baseline.
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v99.txz -C /tmp/s && export PYTHONPATH=/tmp/s/site27k
echo "== tests ($(date +%T))"
(cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py test_softmax_rows.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -12)
echo "== forward_times ($(date +%T))"
python3 tests/gpu/forward_times.py float16 2>&1 | head -9
echo "== bench ($(date +%T))"
timeout 280 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -8
grep -E "kpad|fmask|blhe|prefill1k_d128 " $OUT/bench.md | head -12
echo "== end $(date +%T)"
} 2>&1 | tee $OUT/results.txt
