#!/usr/bin/env bash
# session 37, run v146: the landed decode build (8ca5628 on) on the H200: pip build as a user does,
# GPU tests (test_cuda + sm90 suites), CUDA fuzz, decode cases under four sanitizers, kernel times
# of decode, tail100 and prefill1k_d128 (forward and f+b), statistics kernels on decode.
set -uo pipefail
export PYTHONUNBUFFERED=1
s=$(date +%s)
bash scripts/gpu_run.sh none > $OUT/gpu_run.txt 2>&1
tail -3 $OUT/gpu_run.txt; echo "build done at $(( $(date +%s)-s )) s"
rm -rf build/site37 && cp -r /tmp/site build/site37
export PYTHONPATH=/tmp/site
for tool in memcheck racecheck initcheck synccheck; do
( timeout 200 compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/sanitize_cases.py decode 2>&1 | tail -3 > $OUT/san-$tool.log ) &
done
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda.py tests/python/test_cuda_sm90.py tests/python/test_cuda_sm90_backward.py tests/python/test_cuda_sm90_stats.py 2>&1 | tail -4 | tee $OUT/pytest.log
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/python/test_fuzz.py -k cuda 2>&1 | tail -1 | tee -a $OUT/pytest.log
wait
for f in $OUT/san-*.log; do echo "$f: $(grep -E 'SUMMARY' $f)"; done
echo "tests done at $(( $(date +%s)-s )) s"
{ echo "== float16"; timeout 60 python3 tests/gpu/kernel_times.py float16 decode_s2k_d128 decode_s32k_d128_gqa tail100_d64 prefill1k_d128 prefill1k_d64 2>&1 | grep total; } | tee $OUT/kernel_times.txt
timeout 60 python3 - <<'PY' 2>&1 | tee $OUT/decode_stats.txt
# decode statistics: the fused kernel against chunks (P from the decode forward), fp16
import sys, torch
sys.path.insert(0, "tests/gpu")
from kernel_times import kernel_ms
from sdpa_math.stats import attention_stats
for name, (B, H, Hkv, L, S, E) in {"decode_s2k_d128": (32, 32, 32, 1, 2048, 128), "decode_s32k_d128_gqa": (2, 32, 8, 1, 32768, 128)}.items():
    q = torch.randn(B, H, L, E, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=torch.float16) for _ in range(2))
    for chunk in (False, True):
        kw = dict(col_sum="per_head", row_entropy=True, enable_gqa=H != Hkv)
        if chunk: kw["method"] = "chunks"
        try:
            t = kernel_ms(lambda: attention_stats(q, k, v, **kw))
            print(name, "chunks" if chunk else "fused", f"total {sum(x for _, x in t):.3f}", ", ".join(f"{a} {b:.3f}" for a, b in t[:6]))
        except Exception as e:
            print(name, chunk, "error", e)
PY
echo "all done at $(( $(date +%s)-s )) s"
cd $OUT && tar czf results.tgz san-*.log gpu_run.txt build.log build-check.txt machine.txt 2>/dev/null; rm -f san-*.log build.log build-check.txt machine.txt
