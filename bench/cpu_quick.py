"""A quick CPU comparison for bench/NOTES.md until the harness of the benchmark issue exists:
median time of sdpa_math.attention against PyTorch's math op (forward, and forward+backward
through O and P), same process, same inputs, after warm-up.

    python bench/cpu_quick.py [--threads N]
"""
import argparse
import statistics
import time

import torch

import sdpa_math

aten_math = torch.ops.aten._scaled_dot_product_attention_math


def median_ms(fn, repeat=7):
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(1, 8, 512, 512, 64, False), (1, 8, 1024, 1024, 64, False), (1, 8, 1024, 1024, 64, True),
              (4, 8, 128, 128, 64, False), (1, 8, 256, 1024, 128, False)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'B,H,L,S,E,causal':<28}{'dtype':<10}{'fwd ours':>10}{'fwd math':>10}{'x':>6}{'f+b ours':>10}{'f+b math':>10}{'x':>6}")
    for B, H, L, S, E, causal in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, H, n, E, generator=g).to(dtype).requires_grad_() for n in (L, S, S))
            dO = torch.randn(B, H, L, E).to(dtype)
            dP = torch.randn(B, H, L, S).to(dtype)
            with torch.no_grad():
                f_ours = median_ms(lambda: sdpa_math.attention(q, k, v, is_causal=causal))
                f_math = median_ms(lambda: aten_math(q, k, v, is_causal=causal))

            def fb(fn):
                def run():
                    o, p = fn(q, k, v, is_causal=causal)
                    torch.autograd.backward((o, p), (dO, dP))
                return run
            b_ours = median_ms(fb(sdpa_math.attention), repeat=5)
            b_math = median_ms(fb(aten_math), repeat=5)
            name = f"{B},{H},{L},{S},{E},{int(causal)}"
            print(f"{name:<28}{str(dtype)[6:]:<10}{f_ours:10.2f}{f_math:10.2f}{f_math / f_ours:6.2f}"
                  f"{b_ours:10.2f}{b_math:10.2f}{b_math / b_ours:6.2f}")


if __name__ == "__main__":
    main()
