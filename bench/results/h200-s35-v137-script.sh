#!/usr/bin/env bash
# Session 35, device call v137: the CPU kernels' level-native vectors checked on the H200 host's
# CPU (AVX-512), where the CI machine (AVX2) cannot run them; then the pip build and the decode
# tests refactored in c65cfd8. Binaries carried in .carry/ (built here: cli_old from c65cfd8,
# cli_new and cpu_tests from this change, CPU-only, Release).
set -u
mkdir -p "$OUT"
{ lscpu | grep -E "Model name|^CPU\(s\)"; grep -o -w -E "avx512f|avx512_bf16|amx_tile|avx2" /proc/cpuinfo | sort | uniq -c; } > "$OUT/cpu.txt" 2>&1
{
  for isa in avx512 avx2 baseline; do
    for b in old new; do
      for shape in "--L 256 --S 256" "--L 512 --S 512" "--L 1 --S 2048 --batch 8"; do
        echo "== $b $isa $shape"
        SDPA_MATH_CPU_ISA=$isa .carry/cli_$b $shape --threads 2 --repeat 10 2>&1 | tail -2
      done
    done
  done
} > "$OUT/cpu-cli.txt" 2>&1
for isa in avx512 avx2 baseline; do
  echo "== cpu_tests at $isa: $(SDPA_MATH_CPU_ISA=$isa .carry/cpu_tests --gtest_brief=1 2>&1 | tail -3 | tr '\n' ' ')"
done > "$OUT/cpu-tests.txt" 2>&1
cat "$OUT/cpu.txt" "$OUT/cpu-tests.txt"
SDPA_MATH_PYTEST_ARGS="tests/python/test_cuda.py -k decode" bash scripts/gpu_run.sh tests
grep -E "^(forward|backward)|^==" "$OUT/cpu-cli.txt" | head -80
