#!/usr/bin/env bash
# Sets up, builds once and runs every test: the C++ core (GoogleTest through CTest), the Python
# package against PyTorch (pytest; the GPU tests skip without a GPU), the kvpress integration in
# kvpress's own environment, then the performance gate on the small CPU set. Prints each step's
# time, and a summary of them at the end.
#
# One build serves every step: the package is installed with pip (the route users take) from a
# build folder, build/test, that also holds the C++ tests and the command line, so CTest runs the
# same compiled core that pytest imports. Without a GPU the CUDA code is compiled for sm_80 and
# sm_90a only: every other default architecture (sm_86, sm_89, compute_90 PTX) compiles the same
# sources as sm_80 or sm_90a, so these two catch every compile error, in less than half the time.
# With a GPU (or SDPA_MATH_TEST_CUDA_ARCHS set, in CMake's form) the build takes those instead;
# a user's plain `pip install .` keeps the full default list (CMakeLists.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh

step setup bash scripts/setup.sh
venv=$(bash scripts/setup_python.sh | tail -n 1)
step_done "python environment ($venv)"

if [ -n "${SDPA_MATH_TEST_CUDA_ARCHS:-}" ]; then
  archs=$SDPA_MATH_TEST_CUDA_ARCHS
elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  archs=""  # the default list, as users build it
else
  archs="80-real;90a-real"
fi
build=build/test
# ccache (scripts/setup.sh installs it; CMakeLists.txt uses it when found) keyed on paths relative
# to the clone, so a second clone on the same machine reuses the first one's objects.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
if command -v ccache >/dev/null; then ccache --zero-stats >/dev/null; fi  # the hits printed below: this build's
step build "$venv/bin/pip" install -q --no-build-isolation -C build-dir="$build" \
  -C cmake.define.SDPA_MATH_BUILD_TESTS=ON -C cmake.define.SDPA_MATH_BUILD_TOOLS=ON \
  ${archs:+-C cmake.define.CMAKE_CUDA_ARCHITECTURES="$archs"} .
if command -v ccache >/dev/null; then ccache --show-stats 2>/dev/null | grep -E "Hits|Misses" | head -2 || true; fi

step ctest ctest --test-dir "$build" -j"$(nproc)" --output-on-failure

# A fresh inductor cache per run: compiled graphs must not outlive the op schemas they call.
export TORCHINDUCTOR_CACHE_DIR="$PWD/build/inductor-cache"
rm -rf "$TORCHINDUCTOR_CACHE_DIR"
step pytest "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests/python

# kvpress's presses on the fused statistics, in their own environment (kvpress pins transformers
# below the 5.17 of the main one; scripts/setup_kvpress_env.sh reuses its PyTorch and sdpa_math).
kvenv=$(bash scripts/setup_kvpress_env.sh "$venv" | tail -n 1)
step_done "kvpress environment ($kvenv)"
step kvpress "$kvenv/bin/python" -m pytest -q -p no:cacheprovider tests/python/test_kvpress.py

step gate bash scripts/gate_cpu.sh "$venv"
step_summary
