#!/usr/bin/env bash
# One call on the GPU machine does the whole job: check the machine, load the extension (the
# one carried from the build machine at python/sdpa_math/_C.so, else build it there), run the
# GPU tests, run a subset under compute-sanitizer, and benchmark. Raw results go under $OUT.
#   bash scripts/gpu_run.sh [tests] [sanitize] [bench] [bench-full] [model] [demo] [profile]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
stages=${*:-tests sanitize bench}
log() { echo "== $* ($(date +%T))"; }

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/machine.txt"
if ! python3 -c "import torch, sdpa_math; assert torch._C._dispatch_has_kernel_for_dispatch_key('sdpa_math::forward', 'CUDA')"; then
  log "building the extension here (the carried one did not load)"
  rm -f python/sdpa_math/_C.so
  CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index --target /tmp/site \
    -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real . 2>&1 | tail -20
  export PYTHONPATH=/tmp/site
fi

for stage in $stages; do
  case $stage in
    tests)
      log "pytest (GPU and CPU suites)"
      python3 -m pytest -q -p no:cacheprovider tests/python 2>&1 | tee "$OUT/pytest.log" | tail -25 ;;
    sanitize)
      for tool in memcheck racecheck; do
        log "compute-sanitizer $tool"
        compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/sanitize_cases.py 2>&1 | tail -15 | tee "$OUT/sanitizer-$tool.log"
      done ;;
    bench)
      log "benchmark: anchor shapes, fp16 and bf16"
      python3 -m sdpa_math.bench run --device cuda --set anchors --dtypes float16 bfloat16 --out "$OUT" 2>&1 | tail -30 ;;
    bench-full)
      log "benchmark: anchors and sweep, fp16, bf16, fp32"
      python3 -m sdpa_math.bench run --device cuda --set anchors+sweep --out "$OUT" 2>&1 | tail -50 ;;
    model)
      log "model and transformers tests at GPU sizes"
      python3 -m pytest -q -s -p no:cacheprovider tests/python/test_model.py tests/python/test_transformers.py 2>&1 | tee "$OUT/model.log" | tail -40 ;;
    demo)
      log "demo (TinyLlama layer 0 on the GPU)"
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
