#!/usr/bin/env bash
# session 24, run v77: bsa + fixup. Correctness on the carried build while the package builds the
# user's way (pip, the machine's compilers) in the background; then timings on the pip build.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$OUT/results.txt
{
( rm -rf /tmp/site; s=$(date +%s); CMAKE_BUILD_PARALLEL_LEVEL=12 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc ) &
bpid=$!
mkdir -p /tmp/s && tar -xJf .carry/pack/s24bsa2.tar.xz -C /tmp/s && export PYTHONPATH=/tmp/s/s24bsa2
for tool in memcheck racecheck synccheck; do
  for set in kl all; do
    ( arg=; [ $set = kl ] && arg=kl
      timeout 280 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py $arg > /tmp/san-$tool-$set.full 2>&1
      { grep -E "^=+ +(Invalid|Race|Barrier|Error|Warning)|at .*sdpa_math" /tmp/san-$tool-$set.full | sed -E 's/\+0x[0-9a-f]+//' | sort | uniq -c | cut -c1-300 | head -12
        tail -3 /tmp/san-$tool-$set.full; } > /tmp/san-$tool-$set.log; cp /tmp/san-$tool-$set.full $OUT/ 2>/dev/null ) &
  done
done
echo "== tests carried"; timeout 250 python3 -m pytest -q -p no:cacheprovider tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py tests/python/test_stats.py 2>&1 | grep -E "FAILED|passed|failed|Error" | head -20
SDPA_MATH_FUZZ_PROBLEMS=200 timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | grep -E "fuzz|passed|failed" | tail -3
wait
for tool in memcheck racecheck synccheck; do for set in kl all; do echo "-- $tool $set"; cat /tmp/san-$tool-$set.log; done; done
cat /tmp/build.rc; tail -3 /tmp/build.log
export PYTHONPATH=/tmp/site
so=$(ls /tmp/site/sdpa_math/_C*.so); echo "NEEDED: $(readelf -d "$so" | grep NEEDED | sed -E 's/.*\[(.*)\]/\1/' | tr '\n' ' ')"
echo "exported C++ runtime symbols: $(nm -D --defined-only "$so" | awk '{print $NF}' | grep -cE '^(__cxa_|_ZSt|_ZNSt|_ZNKSt|_ZNSo)')"
echo "== tests pip build"; timeout 150 python3 -m pytest -q -p no:cacheprovider tests/python/test_kl_fused.py tests/python/test_cuda_sm90_backward.py tests/python/test_build.py 2>&1 | grep -E "FAILED|passed|failed" | head
for spec in prefill1k_d128:float16 prefill1k_d128:bfloat16 prefill1k_d64:float16 prefill2k_d128_causal:float16 gqa1k_d128:float16 decode_s2k_d128:float16 long4k_d128_causal:float16; do
  python3 tests/gpu/kl_profile.py ${spec%%:*} ${spec##*:} > $OUT/kl-profile-${spec%%:*}-${spec##*:}.txt 2>&1; head -1 $OUT/kl-profile-${spec%%:*}-${spec##*:}.txt
done
echo "== backward_times pip build"; python3 tests/gpu/backward_times.py float16 2>&1 | tail -8
echo "== stats"; timeout 200 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -3
python3 -m sdpa_math.bench gate $OUT/stats.json bench/baselines/h200-stats.json 2>&1 | tail -8
} 2>&1 | tee $R
cp /tmp/build.log $OUT/build.log
# at most 8 files come back
cd $OUT && tar -czf /tmp/r.tgz . && find . -mindepth 1 -delete && mv /tmp/r.tgz results.tgz && true
