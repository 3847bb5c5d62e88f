#!/usr/bin/env bash
# Creates (once) the kvpress test environment: a virtual environment with requirements-kvpress.txt
# installed, beside the main test environment, without downloading PyTorch again.
#
#   scripts/setup_kvpress_env.sh MAIN_VENV     (MAIN_VENV: what scripts/setup_python.sh printed)
#
# The new environment's site-packages holds a .pth file naming MAIN_VENV's site-packages, so
# PyTorch (and the sdpa_math installed there) is found there; the new environment's own
# site-packages come first on sys.path, so its transformers 5.2.x (kvpress 0.5.5 pins <5.3)
# shadows the main environment's 5.17. pip sees the main environment's packages as installed
# and leaves them alone ("outside environment"): it installs only what is missing or must differ.
# The environment is cached outside the clone under ${SDPA_MATH_CACHE:-$HOME/.cache/sdpa_math},
# keyed by requirements-kvpress.txt, the main environment's path and its Python version.
# Prints the environment's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
main="${1:?usage: scripts/setup_kvpress_env.sh MAIN_VENV}"
main="$(cd "$main" && pwd)"
py="$main/bin/python"
[ -x "$py" ] || { echo "setup_kvpress_env: $py not found" >&2; exit 1; }
main_site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pyver="$("$py" --version 2>&1)"
cache="${SDPA_MATH_CACHE:-$HOME/.cache/sdpa_math}"
key=$( (cat requirements-kvpress.txt; echo "$main"; echo "$pyver") | sha256sum | cut -c1-16)
venv="$cache/venv-kvpress-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "setup_kvpress_env: creating $venv (PyTorch from $main)" >&2
  mkdir -p "$cache"
  rm -rf "$venv"
  # The main environment's interpreter makes the venv: the same Python version, so the
  # main site-packages' compiled modules (torch) load here.
  "$py" -m venv "$venv"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$main_site" > "$site/zz_sdpa_math_main_env.pth"
  torch_before="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r requirements-kvpress.txt >&2
  # pip must not have put another PyTorch into this environment (it would shadow the main one's)
  if [ -d "$site/torch" ]; then
    echo "setup_kvpress_env: pip installed its own torch into $site; expected $torch_before from $main" >&2
    exit 1
  fi
  "$venv/bin/python" - "$torch_before" <<'PY' >&2
import sys, torch, transformers, kvpress, importlib.metadata as md
assert torch.__version__ == sys.argv[1], (torch.__version__, sys.argv[1])
print(f"setup_kvpress_env: torch {torch.__version__} (main environment), transformers {transformers.__version__}, "
      f"kvpress {md.version('kvpress')}")
PY
  touch "$venv/.complete"
fi
echo "$venv"
