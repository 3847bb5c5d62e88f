#!/usr/bin/env bash
# The main job: sets up, builds, and runs the default problem on the CPU backend against the
# float64 reference (error and time). Arguments go to sdpa_math_cli (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >/dev/null
./build/sdpa_math_cli "$@"
