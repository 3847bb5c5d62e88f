"""Where kl_to's forward + backward spends its time on one shape (torch.profiler, CUDA time per
op), next to flash attention's forward + backward: what a fused kernel would have to remove. The
inputs, the reference map, the timed functions and their timing are the harness's own
(bench.make_inputs, bench.run_kl, bench.kl_impls).
    python3 tests/gpu/kl_profile.py [shape] [dtype]   (default prefill1k_d128 float16)"""
import math
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sdpa_math.bench import ANCHORS, aten_math, kl_impls, make_inputs, run_kl

name = sys.argv[1] if len(sys.argv) > 1 else "prefill1k_d128"
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float16")
s = next(x for x in ANCHORS if x.name == name)
q, k, v, _ = make_inputs(s, dtype, "cuda")
scale = 1.0 / math.sqrt(s.D)
timed = run_kl(s, dtype, "cuda", 20, q, k, v, scale)
print(f"{name} {dtype}: median ms {timed['ms']}, ours / flash {timed.get('x_flash', float('nan')):.2f}")

with torch.no_grad():
    _, ref = aten_math(torch.randn_like(q), k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
ours = kl_impls()["ours"]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        ours(*leaves, ref, s, scale)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
