"""Host time of one call with tiny tensors (1, 1, 4, 8) on the CPU: what the Python layer, the
dispatcher and autograd cost per call, with almost no kernel work. Side by side: sdpa_math,
PyTorch's fused SDPA (no P) and the math op; forward without grad, forward with grad, and forward
+ backward through every output. One thread; mean of N calls after a warm-up.

    python bench/host_overhead.py [N]

Autograd runs in C++ (python/sdpa_math/csrc/autograd.cpp). The row "Python autograd over the
ops" runs the same two ops under a torch.autograd.Function instead: the shape a build on
PyTorch's stable ABI would have (its ops are boxed kernels, and autograd must be registered from
Python), so the difference is what that ABI would cost each call (docs/decisions.md)."""
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


class _PythonAutograd(torch.autograd.Function):
    """sdpa_math's forward and backward ops under autograd registered from Python."""

    @staticmethod
    def forward(ctx, q, k, v):
        o, p, lse = torch.ops.sdpa_math.forward(q, k, v, None, 0.0, False, None, None, False, None)
        ctx.save_for_backward(q, k, v, o, p, lse)
        return o, p

    @staticmethod
    def backward(ctx, d_o, d_p):
        q, k, v, o, p, lse = ctx.saved_tensors
        dq, dk, dv, _ = torch.ops.sdpa_math.backward(d_o, d_p, q, k, v, None, lse, o, p, 0.0, False, None, None,
                                                     False, None, [True, True, True, False])
        return dq, dk, dv


def python_autograd(q, k, v):
    return _PythonAutograd.apply(q, k, v)


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

    rows = [("sdpa_math.attention", sdpa_math.attention, True),
            ("Python autograd over the ops", python_autograd, True), ("F.scaled_dot_product_attention (no P)",
            F.scaled_dot_product_attention, False), ("aten math op", math, True)]
    print(f"host time per call, µs (torch {torch.__version__}, one thread, {n} calls)")
    print(f"{'':40s} {'no grad':>9s} {'grad':>9s} {'fwd+bwd':>9s}")
    for name, fn, both in rows:
        print(f"{name:40s} {mean_us(no_grad(fn), n):9.1f} {mean_us(with_grad(fn), n):9.1f} "
              f"{mean_us(fwd_bwd(fn, both), n):9.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
