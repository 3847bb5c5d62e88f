"""Median forward + backward time of sdpa_math through O and P (and through O only) on the anchor
shapes, with the math op beside it: for comparing backward kernel versions in one GPU call (run
once more with SDPA_MATH_SM90=0 for the mma.sync backward). The side-by-side benchmark with every
implementation is sdpa_math.bench.

    python3 tests/gpu/backward_times.py [float16|bfloat16]
"""
import sys

import torch

import sdpa_math

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from forward_times import SHAPES, median_ms  # noqa: E402

aten_math = torch.ops.aten._scaled_dot_product_attention_math


def main():
    dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float16
    for name, (B, H, Hkv, L, S, E, causal) in SHAPES.items():
        q = torch.randn(B, H, L, E, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        g_out = torch.randn(B, H, L, E, device="cuda", dtype=dtype)
        g_probs = torch.randn(B, H, L, S, device="cuda", dtype=dtype)
        gqa = H != Hkv
        row = []
        for label, fn in (("ours", lambda: sdpa_math.attention(q, k, v, None, 0.0, causal, enable_gqa=gqa)),
                          ("math", lambda: aten_math(q, k, v, is_causal=causal, enable_gqa=gqa))):
            def both():
                out, probs = fn()
                torch.autograd.backward((out, probs), (g_out, g_probs))

            def o_only():
                out, _ = fn()
                out.backward(g_out)

            row.append(f"{label} f+b(O,P) {median_ms(both):7.3f}  f+b(O) {median_ms(o_only):7.3f}")
            q.grad = k.grad = v.grad = None
        print(f"{name:24s} " + "   ".join(row), flush=True)


if __name__ == "__main__":
    main()
