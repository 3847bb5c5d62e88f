#!/usr/bin/env bash
# session 27, run v101: A/B of the padded-tile scan, one GPU, nothing else running: site26c (no
# scan), site27k (scan after the barrier, Q from the producer: v99), site27f (Q first, then the
# scan: v100), twice each, interleaved.
set -uo pipefail
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v101.txz -C /tmp/s
for round in 1 2; do for s in site26c site27k site27f; do PYTHONPATH=/tmp/s/$s python3 .carry/ab.py $s; done; done
} 2>&1 | tee $OUT/results.txt
