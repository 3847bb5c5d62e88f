#!/usr/bin/env bash
# session 25, run v86: pass 2 pipelined (u V of tile n and S of tile n + 1 in one turn), carried builds:
# a = main (site25), b = pipelined (site25n), bt = its trace build.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
mkdir -p /tmp/s && for x in site25 site25n site25nt; do tar -xJf .carry/pack/$x.tar.xz -C /tmp/s; done
for tool in memcheck racecheck synccheck; do
  ( PYTHONPATH=/tmp/s/site25n timeout 250 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py > /tmp/san-$tool.full 2>&1
    { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)|at .*sdpa_math" /tmp/san-$tool.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-300 | head -12
      tail -3 /tmp/san-$tool.full; } > /tmp/san-$tool.log ) &
done
for round in 1 2; do for b in site25 site25n; do
  echo "== forward_times $b round $round"; PYTHONPATH=/tmp/s/$b python3 tests/gpu/forward_times.py float16 2>&1 | head -8
done; done
echo "== forward_times bf16 site25n"; PYTHONPATH=/tmp/s/site25n python3 tests/gpu/forward_times.py bfloat16 2>&1 | head -8
mkdir -p /tmp/raw
for shape in prefill1k_d128 long4k_d128_causal; do
  echo "== trace $shape (pipelined)"; PYTHONPATH=/tmp/s/site25nt python3 tests/gpu/trace_forward.py $shape float16 --raw /tmp/raw/$shape.bin 2>&1 | tail -30
done
echo "== tests (pipelined)"; PYTHONPATH=/tmp/s/site25n timeout 300 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda_sm90.py tests/python/test_nonfinite.py tests/python/test_cuda_sm90_stats.py tests/python/test_sass.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -20
PYTHONPATH=/tmp/s/site25n SDPA_MATH_FUZZ_PROBLEMS=200 timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | grep -E "fuzz|passed|failed" | tail -3
wait
for tool in memcheck racecheck synccheck; do echo "-- $tool"; cat /tmp/san-$tool.log; done
cd /tmp/raw && tar -czf $OUT/traces.tgz *.bin
} 2>&1 | tee $R
