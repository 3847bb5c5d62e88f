#!/usr/bin/env bash
# Compares builds of the package carried to the GPU machine (site folders, e.g. .carry/a .carry/b)
# in one call: the sm90 forward's tests against each, then forward_times.py for each, twice in
# turn (a b c a b c) so the spread between rounds shows beside the differences between builds.
#   bash tests/gpu/compare_builds.sh SITE...   (results under $OUT)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for site in "$@"; do
  name=$(basename "$site")
  echo "== tests on build $name ($(date +%T))"
  PYTHONPATH=$site timeout ${SDPA_MATH_COMPARE_TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider \
    tests/python/test_cuda_sm90.py tests/python/test_nonfinite.py tests/python/test_fuzz.py -k "cuda or sm90" \
    > "$OUT/pytest-$name.log" 2>&1
  tail -3 "$OUT/pytest-$name.log"
done
for round in 1 2; do
  for site in "$@"; do
    echo "== forward_times build $(basename "$site") round $round ($(date +%T))"
    PYTHONPATH=$site python3 tests/gpu/forward_times.py ${SDPA_MATH_COMPARE_DTYPE:-float16}
  done
done 2>&1 | tee "$OUT/forward-times.txt"
