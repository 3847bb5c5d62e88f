"""Forward times of prefill1k_d128 under each mask form, for A/B runs of two builds.

    PYTHONPATH=<build A> python3 tests/gpu/mask_ab.py times A [dtype]
    PYTHONPATH=<build B> python3 tests/gpu/mask_ab.py times B [dtype]
    ncu ... python3 tests/gpu/mask_ab.py one fmask [dtype]    # three calls: profile the third
    PYTHONPATH=<build> python3 tests/gpu/mask_ab.py kernels A [dtype]   # each kernel's time

dtype: float16 (default) or bfloat16, of q, k, v and of the float mask.

Masks: none; kpad_last100 ((B, 1, 1, S) bool, the last 100 keys hidden: no tile to skip);
kpad_bench (batch b pads b/8 of its keys, the harness's _kpad row); bool_b1ls_rand ((B, 1, L, S)
bool, 70 % visible: nothing to skip, no neutral tile); fmask ((B, 1, L, S) float, 0 or finfo.min
on the last 100 keys); fmask_bench (the harness's _fmask row: batch b pads b/8 of its keys);
fmask_bhls (as fmask, materialised per head: (B, H, L, S)); fmask32 (as fmask, in fp32); hfmask
(Hugging Face's causal-and-padding bool mask); then is_causal.
Median of 40 single-event timings: good for a ±5 % comparison in one run, not for the record
(the harness is that).
"""
import sys

import torch

import sdpa_math

B, H, L, S, E = 4, 16, 1024, 1024, 128


def masks(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    ar = torch.arange(S, device="cuda")
    rows = torch.arange(L, device="cuda")[:, None]
    return g, {
        "none": lambda: None,
        "kpad_last100": lambda: (ar < S - 100).expand(B, S)[:, None, None].contiguous(),
        "kpad_bench": lambda: (ar < S - torch.arange(B, device="cuda")[:, None] * S // (2 * B))[:, None, None].contiguous(),
        "bool_b1ls_rand": lambda: torch.rand(B, 1, L, S, device="cuda", generator=g) < 0.7,
        "fmask": lambda: torch.where(ar < S - 100, 0.0, torch.finfo(dtype).min)
        .to(dtype)
        .expand(B, 1, L, S)
        .contiguous(),
        "fmask_bench": lambda: torch.where(ar < S - torch.arange(B, device="cuda")[:, None] * S // (2 * B), 0.0,
                                           torch.finfo(dtype).min).to(dtype)[:, None, None].expand(B, 1, L, S).contiguous(),
        "fmask_bhls": lambda: torch.where(ar < S - 100, 0.0, torch.finfo(dtype).min)
        .to(dtype)
        .expand(B, H, L, S)
        .contiguous(),
        "fmask32": lambda: torch.where(ar < S - 100, 0.0, torch.finfo(torch.float32).min)
        .expand(B, 1, L, S)
        .contiguous(),
        "hfmask": lambda: ((ar <= rows) & (ar < S - 100)).expand(B, 1, L, S).contiguous(),
    }


def median_ms(f, n=40):
    for _ in range(5):
        f()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2]


def main():
    mode, name = sys.argv[1], sys.argv[2]
    dtype = getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float16
    g, made = masks(dtype)
    q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    if mode == "one":
        mask = made[name]()
        for _ in range(3):
            sdpa_math.attention(q, k, v, mask)
        torch.cuda.synchronize()
        return
    if mode == "kernels":  # each mask's CUDA kernels, mean µs of 20 calls (torch profiler)
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from kernel_times import kernel_ms

        for n, make in made.items():
            mask = make()
            times = kernel_ms(lambda: sdpa_math.attention(q, k, v, mask), calls=20)
            print(name, n, " ".join(f"{k}={t * 1000:.1f}" for k, t in times), flush=True)
        return
    res = {}
    for n, make in made.items():
        mask = make()
        res[n] = median_ms(lambda: sdpa_math.attention(q, k, v, mask))
    res["causal"] = median_ms(lambda: sdpa_math.attention(q, k, v, is_causal=True))
    print(name, " ".join(f"{n}={t:.4f}" for n, t in res.items()), flush=True)


if __name__ == "__main__":
    main()
