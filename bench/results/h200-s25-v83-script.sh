#!/usr/bin/env bash
# session 25, run v83: the forward's timeline (trace build, carried) and the trace's own cost.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
mkdir -p /tmp/s && for x in site25 site25t; do tar -xJf .carry/pack/$x.tar.xz -C /tmp/s; done
echo "== forward_times, normal build"; PYTHONPATH=/tmp/s/site25 python3 tests/gpu/forward_times.py float16 2>&1 | head -7
echo "== forward_times, trace build (stamps on, no file)"; PYTHONPATH=/tmp/s/site25t python3 tests/gpu/forward_times.py float16 2>&1 | head -7
mkdir -p /tmp/raw
for shape in prefill1k_d128 prefill1k_d64 gqa1k_d128 long4k_d128_causal prefill2k_d128_causal; do
  echo "== trace $shape"; PYTHONPATH=/tmp/s/site25t python3 tests/gpu/trace_forward.py $shape float16 --raw /tmp/raw/$shape.bin 2>&1 | tail -30
done
cd /tmp/raw && tar -czf $OUT/traces.tgz *.bin
} 2>&1 | tee $R
