#!/usr/bin/env bash
# Installs what the C++ build needs, from Debian's packages, where it is missing:
# a C++17 compiler, CMake, GoogleTest, OpenMP (GCC's libgomp comes with g++), QEMU's user-mode
# emulator (the CPU kernels' tests on emulated older CPUs, x86-64 only), and ccache (rebuilds of
# unchanged sources come from its cache: CMakeLists.txt uses it when found).
set -euo pipefail
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
[ "$(uname -m)" != x86_64 ] || command -v qemu-x86_64 >/dev/null || missing+=(qemu-user)
command -v ccache >/dev/null || missing+=(ccache)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
