"""Where kl_to's forward + backward spends its time on one shape (torch.profiler, CUDA time per
op), next to flash attention's forward + backward: what a fused kernel would have to remove.
    python3 tests/gpu/kl_profile.py [shape] [dtype]   (default prefill1k_d128 float16)"""
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from sdpa_math.bench import ANCHORS, aten_math
from sdpa_math.stats import attention_stats

name = sys.argv[1] if len(sys.argv) > 1 else "prefill1k_d128"
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "float16")
s = next(x for x in ANCHORS if x.name == name)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(s.B, h, n, s.D, device="cuda", dtype=dtype, generator=g)
           for h, n in ((s.Hq, s.L), (s.Hkv, s.S), (s.Hkv, s.S)))
gqa = s.Hq != s.Hkv
with torch.no_grad():
    _, ref = aten_math(torch.randn_like(q), k, v, is_causal=s.causal, enable_gqa=gqa)
leaves = [t.requires_grad_(True) for t in (q, k, v)]


def ours():
    _, st = attention_stats(*leaves, is_causal=s.causal, enable_gqa=gqa, kl_to=ref)
    return torch.autograd.grad(st["kl_to"].sum(), leaves[:2])


def flash():
    out = F.scaled_dot_product_attention(*leaves, is_causal=s.causal, enable_gqa=gqa)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


for fn in (ours, flash):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn()
    end.record()
    torch.cuda.synchronize()
    print(f"{fn.__name__}: {start.elapsed_time(end) / 20:.3f} ms per forward + backward ({name}, {dtype})")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        ours()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
