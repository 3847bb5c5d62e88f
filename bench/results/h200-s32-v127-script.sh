#!/usr/bin/env bash
# session 32, run v127: branch natural-fold (a bf16 mask's clean tiles take the base-2 kernels'
# one multiply-add exponent) in one call: the package pip built on the H200 in the background;
# meanwhile the GPU tests on the carried build (site_nf) and forward_times of main (site_m32)
# against it, fp16 and bf16, interleaved; then the pip build's tests and the harness on it
# (anchors+variants, fp16 + bf16), gated against the baselines. No sanitizers in this call (the
# change is arithmetic on registers only; see NOTES).
set -uo pipefail
export PYTHONUNBUFFERED=1
{
mkdir -p /tmp/s && tar -xJf .carry/pack/v127.txz -C /tmp/s
s=$(date +%s); (CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 300 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . > /tmp/build.log 2>&1; echo "pip build rc=$? in $(( $(date +%s)-s )) s" > /tmp/build.rc) &
echo "== carried natural-fold tests"
(cd tests/python && PYTHONPATH=/tmp/s/site_nf timeout 120 python3 -m pytest -q -p no:cacheprovider test_cuda_sm90.py test_nonfinite.py 2>&1 | grep -E "FAILED|passed|failed|rror" | head -20)
for dt in bfloat16 float16; do
  for round in 1 2; do
    for s in site_m32 site_nf; do echo "== $s $dt r$round"; PYTHONPATH=/tmp/s/$s timeout 60 python3 tests/gpu/forward_times.py $dt | cut -c1-40 | head -7; done
  done
done
wait; cat /tmp/build.rc; tail -3 /tmp/build.log > $OUT/build-tail.log
export PYTHONPATH=/tmp/site
echo "== pip build tests"
(cd tests/python && timeout 100 python3 -m pytest -q -p no:cacheprovider test_build.py test_sass.py test_cuda_sm90.py -k "build or sass or mask" 2>&1 | grep -E "FAILED|passed|failed|rror" | head -10)
timeout 200 python3 -m sdpa_math.bench run --device cuda --set anchors+variants --dtypes float16 bfloat16 --out $OUT 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/bench.json bench/baselines/h200.json --subset 2>&1 | tail -14
} 2>&1 | tee $OUT/results.txt
