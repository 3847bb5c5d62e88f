"""A/B of the padded-tile scan: forward times (fp16, prefill1k_d128's shape) of the build on PYTHONPATH."""
import sys
import torch
import sdpa_math

B, H, L, S, E = 4, 16, 1024, 1024, 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
ar = torch.arange(S, device="cuda")
masks = {
    "none": None,
    "kpad_last100": (ar < S - 100).expand(B, S)[:, None, None].contiguous(),
    "kpad_bench": (ar < S - torch.arange(B, device="cuda")[:, None] * S // (2 * B))[:, None, None].contiguous(),
    "bool_b1ls_rand": torch.rand(B, 1, L, S, device="cuda", generator=g) < 0.7,
}


def med(f, n=40):
    for _ in range(5):
        f()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2]


print(sys.argv[1], " ".join(f"{n}={med(lambda: sdpa_math.attention(q, k, v, m)):.4f}" for n, m in masks.items()), flush=True)
