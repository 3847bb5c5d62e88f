#!/usr/bin/env bash
# session 25, run v87: finer pass-2 stamps (P's buffer free, P staged), main against the pipelined pass 2.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
mkdir -p /tmp/s /tmp/raw && for x in site25t2 site25pt; do tar -xJf .carry/pack/$x.tar.xz -C /tmp/s; done
for x in site25t2 site25pt; do for shape in prefill1k_d128 prefill1k_d64; do
  echo "== trace $x $shape"; PYTHONPATH=/tmp/s/$x python3 tests/gpu/trace_forward.py $shape float16 --raw /tmp/raw/$x-$shape.bin 2>&1 | sed -n 1,26p
done; done
cd /tmp/raw && tar -czf $OUT/traces.tgz *.bin
} 2>&1 | tee $R
