#!/usr/bin/env bash
# Installs the package into an existing virtual environment (which holds the PyTorch to test) by
# each route a user has, and runs the test suite against each install from outside the source tree:
#   1. pip install --no-build-isolation .
#   2. pip install .                      (pip's isolated build environment)
#   3. python -m build --wheel --no-isolation, then pip install of that wheel
#   4. python -m build --wheel (isolated: builds for the newest PyTorch on the registry), then the wheel
#   bash scripts/check_install_routes.sh VENV [LOG]
# CPU-only builds (SDPA_MATH_CUDA=OFF): the CUDA kernels need nvcc and a GPU to test. The isolated
# routes download the build requirements (PyTorch among them) into a throwaway environment, so this
# is run by hand, not in CI (which tests route 1 and the wheel of route 3 without isolation).
set -uo pipefail
venv=$1
log=${2:-/dev/stdout}
src=$(cd "$(dirname "$0")/.." && pwd)
py=$venv/bin/python
cpu=(-C cmake.define.SDPA_MATH_CUDA=OFF)
run_tests() {
  (cd /tmp && "$py" -c "import sdpa_math, torch; print('sdpa_math', sdpa_math.__version__, 'from', sdpa_math.__file__, 'torch', torch.__version__)" \
    && PYTHONPATH=$src/tests/python "$py" -m pytest -q -p no:cacheprovider "$src/tests/python" 2>&1 | tail -3)
}
{
  echo "== $(date -u +%FT%TZ) torch $("$py" -c 'import torch; print(torch.__version__)')"
  echo "== route 1: pip install --no-build-isolation ."
  "$py" -m pip uninstall -q -y sdpa_math 2>/dev/null
  "$py" -m pip install -q --no-build-isolation --no-deps "${cpu[@]}" "$src" && run_tests
  echo "== route 2: pip install . (isolated build)"
  "$py" -m pip uninstall -q -y sdpa_math
  "$py" -m pip install -q --no-deps "${cpu[@]}" "$src" && run_tests
  echo "== route 3: python -m build --wheel --no-isolation, then the wheel"
  "$py" -m pip uninstall -q -y sdpa_math
  rm -rf /tmp/sdpa_math-wheel && "$py" -m build --wheel --no-isolation --outdir /tmp/sdpa_math-wheel "${cpu[@]}" "$src" \
    > /tmp/sdpa_math-build.log 2>&1 && ls /tmp/sdpa_math-wheel && "$py" -m pip install -q --no-deps /tmp/sdpa_math-wheel/*.whl \
    && run_tests || tail -20 /tmp/sdpa_math-build.log
  # python -m build's isolated environment is a fresh virtual environment that cannot see this one:
  # it builds against the newest PyTorch on the registry. In an environment with that release the
  # wheel must pass the tests; with another release, importing it must be the one clear ImportError.
  echo "== route 4: python -m build --wheel (isolated), then the wheel"
  "$py" -m pip uninstall -q -y sdpa_math
  rm -rf /tmp/sdpa_math-wheel && "$py" -m build --wheel --outdir /tmp/sdpa_math-wheel "${cpu[@]}" "$src" > /tmp/sdpa_math-build.log 2>&1 \
    && "$py" -m pip install -q --no-deps /tmp/sdpa_math-wheel/*.whl || tail -20 /tmp/sdpa_math-build.log
  built=$(grep -o "building against PyTorch [^ ]*" /tmp/sdpa_math-build.log | awk '{print $4}')
  if [ "$built" = "$("$py" -c 'import torch; print(torch.__version__)')" ]; then
    run_tests
  else
    echo "wheel built for PyTorch $built; importing it here:"
    (cd /tmp && "$py" -c "import sdpa_math" 2>&1 | tail -1)
  fi
  "$py" -m pip uninstall -q -y sdpa_math
} 2>&1 | tee "$log"
