"""CUDA kernel times (torch profiler, mean of 10 calls) of sdpa_math's forward and of its forward +
backward through O and P, on shapes of forward_times.SHAPES: which kernel a change moved.

    python3 tests/gpu/kernel_times.py [float16|bfloat16] SHAPE...
"""
import re
import sys

import torch

import sdpa_math

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from forward_times import SHAPES  # noqa: E402


def kernel_ms(step, calls=10):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            found = re.search(r"::(\w+)<", e.name) or re.search(r"(\w+)\(", e.name)
            key = found.group(1) if found else e.name[:30]
            agg[key] = agg.get(key, 0.0) + e.device_time / calls / 1000
    return sorted(agg.items(), key=lambda kv: -kv[1])


def main():
    args = sys.argv[1:]
    dtype = getattr(torch, args.pop(0)) if args and args[0] in ("float16", "bfloat16", "float32") else torch.float16
    for name in args or list(SHAPES):
        B, H, Hkv, L, S, E, causal = SHAPES[name]
        q = torch.randn(B, H, L, E, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        g_out, g_p = torch.randn(B, H, L, E, device="cuda", dtype=dtype), torch.randn(B, H, L, S, device="cuda", dtype=dtype)
        gqa = H != Hkv

        def fwd():
            with torch.no_grad():
                sdpa_math.attention(q, k, v, None, 0.0, causal, enable_gqa=gqa)

        def both():
            out, p = sdpa_math.attention(q, k, v, None, 0.0, causal, enable_gqa=gqa)
            torch.autograd.grad((out, p), (q, k, v), (g_out, g_p))

        for label, step in (("forward", fwd), ("f+b(O,P)", both)):
            times = kernel_ms(step)
            total = sum(t for _, t in times)
            print(f"{name} {label}: total {total:.3f} ms: " + ", ".join(f"{k} {t:.3f}" for k, t in times[:8]), flush=True)


if __name__ == "__main__":
    main()
