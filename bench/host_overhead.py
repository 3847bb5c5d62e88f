"""Host time of one call with tiny tensors (1, 1, 4, 8) on the CPU: what the Python layer, the
dispatcher and autograd cost per call, with almost no kernel work. Side by side: sdpa_math,
PyTorch's fused SDPA (no P) and the math op; forward without grad, forward with grad, and forward
+ backward through every output. One thread; mean of N calls after a warm-up.

    python bench/host_overhead.py [N]

Session 15 moved autograd from torch.library's Python registration into C++
(python/sdpa_math/csrc/autograd.cpp); the before/after figures are in bench/NOTES.md."""
import sys
import time

import torch
import torch.nn.functional as F

import sdpa_math


def mean_us(fn, n):
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(n=3000):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8, generator=g) for _ in range(3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    d_out, d_probs = torch.randn(1, 1, 4, 8, generator=g), torch.randn(1, 1, 4, 4, generator=g)
    math = torch.ops.aten._scaled_dot_product_attention_math

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run

    def with_grad(fn):
        return lambda: fn(*leaves)

    def fwd_bwd(fn, both=True):
        def run():
            res = fn(*leaves)
            if both:
                torch.autograd.grad(res, leaves, (d_out, d_probs))
            else:
                torch.autograd.grad(res, leaves, d_out)
        return run

    rows = [("sdpa_math.attention", sdpa_math.attention, True), ("F.scaled_dot_product_attention (no P)",
            F.scaled_dot_product_attention, False), ("aten math op", math, True)]
    print(f"host time per call, µs (torch {torch.__version__}, one thread, {n} calls)")
    print(f"{'':40s} {'no grad':>9s} {'grad':>9s} {'fwd+bwd':>9s}")
    for name, fn, both in rows:
        print(f"{name:40s} {mean_us(no_grad(fn), n):9.1f} {mean_us(with_grad(fn), n):9.1f} "
              f"{mean_us(fwd_bwd(fn, both), n):9.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
