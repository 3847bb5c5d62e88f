#!/usr/bin/env bash
# One call on the GPU machine does the whole job: check the machine, build the package there the
# way a user does (pip with that machine's own compilers), check the build, run the GPU tests,
# run a subset under compute-sanitizer, and benchmark. Raw results go under $OUT.
#   bash scripts/gpu_run.sh [tests] [sanitize] [initcheck-repro] [cpu-only] [bench] [stats] [kl] [kl-ncu] [bench-full] [model] [demo] [profile]
# SDPA_MATH_PYTEST_ARGS: what the tests stage runs (default tests/python). SDPA_MATH_KL_PROFILES: the kl stage's shape:dtype profiles. SDPA_MATH_GPU_ARCHS: the CUDA architectures to build (default 90a-real: the H200; a user's plain
# `pip install .` builds the CMake default list). SDPA_MATH_CARRIED=1 uses a build carried from the
# build machine at python/sdpa_math/_C.so (or the site folder SDPA_MATH_CARRIED_SITE) instead (a
# second configuration, not the one users run). SDPA_MATH_BENCH_SET, SDPA_MATH_BENCH_DTYPES: the bench stage's rows.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
stages=${*:-tests sanitize bench}
log() { echo "== $* ($(date +%T))"; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/machine.txt"
echo "CXX=${CXX:-} CC=${CC:-} CUDAHOSTCXX=${CUDAHOSTCXX:-}" >> "$OUT/machine.txt"
if [ "${SDPA_MATH_CARRIED:-0}" = 1 ]; then
  export PYTHONPATH=${SDPA_MATH_CARRIED_SITE:-$PWD/python}
else
  log "building the package as a user does (pip, this machine's compilers)"
  rm -rf /tmp/site python/sdpa_math/_C.so
  if ! CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site \
      -C cmake.define.CMAKE_CUDA_ARCHITECTURES="${SDPA_MATH_GPU_ARCHS:-90a-real}" . > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
  fi
  export PYTHONPATH=/tmp/site  # the built package, not the source tree's
  so=$(ls /tmp/site/sdpa_math/_C*.so)
  { echo "NEEDED:"; readelf -d "$so" | grep NEEDED
    echo "exported C++ runtime symbols: $(nm -D --defined-only "$so" | awk '{print $NF}' | grep -cE '^(__cxa_|_ZSt|_ZNSt|_ZNKSt|_ZNSo)')"; } \
    | tee "$OUT/build-check.txt"
fi
python3 -c "import torch, sdpa_math; print('sdpa_math from', sdpa_math.__file__); assert torch.ops.sdpa_math.built_with_cuda()"

for stage in $stages; do
  case $stage in
    tests)
      log "pytest (GPU and CPU suites)"
      python3 -m pytest -q -p no:cacheprovider ${SDPA_MATH_PYTEST_ARGS:-tests/python} 2>&1 | tee "$OUT/pytest.log" | tail -25 ;;
    sanitize)
      # Every tool over the contract's kernel families and over the fuzz problems
      # (SDPA_MATH_FUZZ_PROBLEMS, default 25; 200 is the whole fuzz test). initcheck does not see the
      # Hopper forward's TMA stores of P (tests/gpu/initcheck_tma.py): it also runs with the Hopper
      # kernels off (SDPA_MATH_SM90=0), and on P copied by an ordinary kernel. The runs are
      # independent processes, so they share the GPU and run side by side (a sanitizer's cost is
      # mostly host time); each has SDPA_MATH_SANITIZE_TIMEOUT seconds (default 200).
      tmo=${SDPA_MATH_SANITIZE_TIMEOUT:-200}
      fuzz=${SDPA_MATH_FUZZ_PROBLEMS:-25}
      log "compute-sanitizer: 4 tools on the kernel families, 4 (+initcheck with SM90=0) on $fuzz fuzz problems, side by side"
      for tool in memcheck racecheck synccheck initcheck; do
        ( timeout $tmo compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/sanitize_cases.py 2>&1 | tail -15 \
            > "$OUT/sanitizer-$tool.log" ) &
        ( SDPA_MATH_FUZZ_PROBLEMS=$fuzz timeout $tmo compute-sanitizer --tool $tool --print-limit 20 \
            python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | tail -12 > "$OUT/sanitizer-fuzz-$tool.log" ) &
      done
      ( SDPA_MATH_SM90=0 SDPA_MATH_FUZZ_PROBLEMS=$fuzz timeout $tmo compute-sanitizer --tool initcheck --print-limit 20 \
          python3 -m pytest -q -s -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | tail -12 > "$OUT/sanitizer-fuzz-initcheck-sm90off.log" ) &
      for variant in own kernel; do
        ( timeout 120 compute-sanitizer --tool initcheck --print-limit 5 python3 tests/gpu/initcheck_tma.py $variant 2>&1 | tail -6 \
            > "$OUT/sanitizer-initcheck-tma-$variant.log" ) &
      done
      wait
      for f in "$OUT"/sanitizer-*.log; do echo "-- ${f##*/}"; grep -E "SUMMARY|passed|failed|problems|rror" "$f" | tail -4; done ;;
    initcheck-repro)
      # Does initcheck follow writes made by the bulk-copy (TMA) unit? Standalone, no sdpa_math code.
      log "initcheck on tests/gpu/initcheck_bulk_store.cu"
      nvcc -arch=sm_90a -o /tmp/initcheck_bulk_store tests/gpu/initcheck_bulk_store.cu > "$OUT/initcheck-repro.log" 2>&1 \
        && /tmp/initcheck_bulk_store >> "$OUT/initcheck-repro.log" 2>&1 \
        && compute-sanitizer --tool initcheck --print-limit 6 /tmp/initcheck_bulk_store >> "$OUT/initcheck-repro.log" 2>&1
      tail -30 "$OUT/initcheck-repro.log" ;;
    cpu-only)
      # A build without CUDA on purpose: CUDA tensors must get sdpa_math's own error.
      log "CPU-only build (SDPA_MATH_CUDA=OFF) and its tests"
      rm -rf /tmp/site-cpu
      if CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site-cpu \
          -C build-dir=build/cpu-only -C cmake.define.SDPA_MATH_CUDA=OFF . > "$OUT/build-cpu-only.log" 2>&1; then
        PYTHONPATH=/tmp/site-cpu python3 -m pytest -q -p no:cacheprovider tests/python/test_build.py -k "cpu_only or exports or links" \
          2>&1 | tee "$OUT/pytest-cpu-only.log" | tail -5
      else
        tail -20 "$OUT/build-cpu-only.log"
      fi ;;
    bench)
      log "benchmark: anchor shapes and input variants, fp16 and bf16"
      python3 -m sdpa_math.bench run --device cuda --set ${SDPA_MATH_BENCH_SET:-anchors+variants} \
        --dtypes ${SDPA_MATH_BENCH_DTYPES:-float16 bfloat16} --out "$OUT" 2>&1 | tail -40 ;;
    stats)
      # The statistics rows (issue 16), gated against the committed H200 statistics baseline.
      log "statistics of P: bench stats, fp16 and bf16, and its gate"
      timeout ${SDPA_MATH_STATS_TIMEOUT:-900} python3 -m sdpa_math.bench stats --device cuda --set anchors \
        --dtypes ${SDPA_MATH_BENCH_DTYPES:-float16 bfloat16} --out "$OUT" 2>&1 | tail -20
      # Every baseline row is judged (a run cut short by the timeout fails), unless the dtypes
      # were narrowed on purpose.
      python3 -m sdpa_math.bench gate "$OUT/stats.json" bench/baselines/h200-stats.json \
        ${SDPA_MATH_BENCH_DTYPES:+--subset} 2>&1 | tail -20 ;;
    kl)
      # kl_to on CUDA (issue 16): its tests against float64 (the fused kernels and the Hopper
      # backward they share), three sanitizers on its calls alone (side by side with the tests),
      # and where its forward + backward spends its time next to flash attention's
      # (tests/gpu/kl_profile.py).
      log "kl_to: tests and sanitizers on CUDA, profile"
      # kl_to's forward runs PyTorch's cuDNN attention, whose kernel racecheck reports (2 hazards
      # on every run so far), which is not ours to fix: the log names each reported kernel, so a
      # hazard in ours shows. (Filtering racecheck to our kernels, --kernel-name kns=sdpa_math,
      # made the sanitizer fail on a hardware exception.)
      for tool in memcheck racecheck synccheck; do
        ( timeout 200 compute-sanitizer --tool $tool --print-limit 10 python3 tests/gpu/sanitize_cases.py kl > "$OUT/sanitizer-kl-$tool.full" 2>&1
          { sed -nE -e 's/.*(Read|Write) access at (.*)\+0x[0-9a-f]+.*/\1 \2/p' -e 's/^=+ +at (.*)\+0x[0-9a-f]+.*/at \1/p' \
              "$OUT/sanitizer-kl-$tool.full" | sort | uniq -c
            tail -4 "$OUT/sanitizer-kl-$tool.full"; } > "$OUT/sanitizer-kl-$tool.log"; rm -f "$OUT/sanitizer-kl-$tool.full" ) &
      done
      python3 -m pytest -q -p no:cacheprovider tests/python/test_stats.py tests/python/test_kl_fused.py \
        tests/python/test_cuda_sm90_backward.py 2>&1 | tee "$OUT/pytest-kl.log" | tail -5
      wait
      for f in "$OUT"/sanitizer-kl-*.log; do echo "-- ${f##*/}"; grep -E "SUMMARY|finished" "$f"; done
      for spec in ${SDPA_MATH_KL_PROFILES:-prefill1k_d128:float16 prefill1k_d128:bfloat16 prefill1k_d64:float16 \
          prefill2k_d128_causal:float16 gqa1k_d128:float16 decode_s2k_d128:float16 long4k_d128_causal:float16}; do
        python3 tests/gpu/kl_profile.py ${spec%%:*} ${spec##*:} > "$OUT/kl-profile-${spec%%:*}-${spec##*:}.txt" 2>&1
        head -2 "$OUT/kl-profile-${spec%%:*}-${spec##*:}.txt"
      done ;;
    kl-ncu)
      # Why kl_to's two Hopper kernels (kl_forward, the KL backward) take the time they do, one
      # launch of each on prefill1k_d128 fp16 (clocks not locked): the warp-stall reasons per
      # issued instruction, issue rate, DRAM and tensor-pipe use (ncu-kl-stalls.txt), and the
      # stall samples of every SASS instruction (ncu-kl-source.csv.gz; the report itself,
      # ncu-kl.ncu-rep, opens in Nsight Compute).
      log "ncu: kl_forward and the KL backward, stall reasons and per-instruction samples"
      timeout 300 ncu --clock-control none --kernel-name regex:'kl_forward_sm90|backward_sm90' --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
        --section SourceCounters \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$,smsp__inst_executed.sum,smsp__cycles_active.avg,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum' \
        -o "$OUT/ncu-kl" python3 tests/gpu/kl_profile.py prefill1k_d128 float16 > "$OUT/ncu-kl-run.txt" 2>&1
      ncu -i "$OUT/ncu-kl.ncu-rep" --page details > "$OUT/ncu-kl-stalls.txt" 2>&1
      ncu -i "$OUT/ncu-kl.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu-kl-source.csv.gz"
      grep -E "sm90<|Duration|DRAM Throughput|hmma|Issued Warp|stalled_(long|wait|barrier|no_inst|short|math)" "$OUT/ncu-kl-stalls.txt" | cut -c1-120 ;;
    bench-full)
      log "benchmark: anchors and sweep, fp16, bf16, fp32"
      python3 -m sdpa_math.bench run --device cuda --set anchors+sweep --out "$OUT" 2>&1 | tail -50 ;;
    model)
      log "model and transformers tests at GPU sizes"
      python3 -m pytest -q -s -p no:cacheprovider tests/python/test_model.py tests/python/test_transformers.py 2>&1 | tee "$OUT/model.log" | tail -40 ;;
    demo)
      log "demo (a tiny model learns an induction head, on the GPU)"
      python3 -m sdpa_math demo --out "$OUT/demo.png" 2>&1 | tee "$OUT/demo.log" | tail -20 ;;
    profile)
      # Where the tensor-core kernels spend their time, for the next performance step.
      for shape in ${PROFILE_SHAPES:-prefill1k_d128 decode_s2k_d128}; do
        log "ncu $shape"
        ncu --clock-control none --kernel-name regex:'forward_tc|backward_tc|decode_' --launch-skip 4 --launch-count 4 \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
          python3 tests/gpu/profile_anchor.py $shape > "$OUT/ncu-$shape.txt" 2>&1
        tail -5 "$OUT/ncu-$shape.txt"
      done ;;
  esac
done
log done
# The device tool brings back at most 8 files: more than that leave as one archive.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar -czf /tmp/gpu-run-results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu-run-results.tgz "$OUT/results.tgz"
  echo "results packed into results.tgz (more than 8 files)"
fi
