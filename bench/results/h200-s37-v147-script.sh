#!/usr/bin/env bash
# session 37, run v147: decode statistics on the decode kernels (decode_stats). pip build as a
# user does; stats tests (decode, sm90, CPU-side stats, kl), decode tests of test_cuda; sanitizers
# on the decode set (now with statistics); decode stats kernel times; bench stats + gate.
set -uo pipefail
export PYTHONUNBUFFERED=1
s=$(date +%s)
bash scripts/gpu_run.sh none > $OUT/gpu_run.txt 2>&1
tail -3 $OUT/gpu_run.txt; echo "build done at $(( $(date +%s)-s )) s"
rm -rf build/site37 && cp -r /tmp/site build/site37
export PYTHONPATH=/tmp/site
for tool in memcheck racecheck initcheck synccheck; do
( timeout 200 compute-sanitizer --tool $tool --print-limit 20 python3 tests/gpu/sanitize_cases.py decode 2>&1 | tail -8 > $OUT/san-$tool.log ) &
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/python/test_cuda_decode_stats.py tests/python/test_cuda_sm90_stats.py tests/python/test_stats.py tests/python/test_kl_fused.py 2>&1 | tail -15 | tee $OUT/pytest.log
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/python/test_cuda.py -k "decode" 2>&1 | tail -2 | tee -a $OUT/pytest.log
wait
for f in $OUT/san-*.log; do echo "$f: $(grep -E 'SUMMARY|finished' $f | tr '\n' ' ')"; done
echo "tests done at $(( $(date +%s)-s )) s"
timeout 60 python3 - <<'PY' 2>&1 | tee $OUT/decode_stats.txt
import sys, torch
sys.path.insert(0, "tests/gpu")
from kernel_times import kernel_ms
from sdpa_math.stats import attention_stats
for name, (B, H, Hkv, L, S, E) in {"decode_s2k_d128": (32, 32, 32, 1, 2048, 128), "decode_s32k_d128_gqa": (2, 32, 8, 1, 32768, 128)}.items():
    for dt in (torch.float16, torch.bfloat16):
        q = torch.randn(B, H, L, E, device="cuda", dtype=dt)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=dt) for _ in range(2))
        for label, kw in (("cols+ent", dict(col_sum="per_head", row_entropy=True)), ("rows", dict(rows=slice(-64, None)))):
            t = kernel_ms(lambda: attention_stats(q, k, v, enable_gqa=H != Hkv, **kw))
            print(name, dt, label, f"total {sum(x for _, x in t):.3f}", ", ".join(f"{a} {b:.3f}" for a, b in t[:6]))
PY
timeout 60 python3 tests/gpu/stats_times.py float16 2>&1 | tee $OUT/stats_times.txt
timeout 150 python3 -m sdpa_math.bench stats --device cuda --set anchors --dtypes float16 bfloat16 --out $OUT/stats 2>&1 | tail -1
python3 -m sdpa_math.bench gate $OUT/stats/stats.json bench/baselines/h200-stats.json --subset 2>&1 | tail -8
echo "all done at $(( $(date +%s)-s )) s"
cd $OUT && tar czf results.tgz san-*.log gpu_run.txt build.log build-check.txt machine.txt stats 2>/dev/null; rm -rf san-*.log build.log build-check.txt machine.txt stats
