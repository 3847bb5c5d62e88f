#!/usr/bin/env bash
# session 27, run v102: the final forward (scan of key-padding masks only, Q from the producer
# as before; carried build site27g): the sm90 tests, memcheck on the padded-tile test, and the A/B
# against site26c (no scan).
set -uo pipefail
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v102.txz -C /tmp/s
(cd tests/python && PYTHONPATH=/tmp/s/site27g timeout 90 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py -k "cuda or sm90" 2>&1 | grep -E "FAILED|passed|failed" | head -8)
(cd tests/python && PYTHONPATH=/tmp/s/site27g timeout 60 compute-sanitizer --tool memcheck python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py -k padded 2>&1 | grep -E "passed|failed|ERROR SUMMARY" | head -3)
for round in 1 2; do for s in site26c site27g; do PYTHONPATH=/tmp/s/$s python3 .carry/ab.py $s; done; done
} 2>&1 | tee $OUT/results.txt
