#!/usr/bin/env bash
# Sets up, builds and runs every test (GoogleTest through CTest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
ctest --test-dir build -j"$(nproc)" --output-on-failure
