"""Median forward time of sdpa_math (O and P) on the issue's anchor shapes and input variants, one
line per shape: for comparing kernel versions in one GPU call (run once with SDPA_MATH_SM90=0 for
the mma.sync path). The side-by-side benchmark with the other implementations is sdpa_math.bench.

    python3 tests/gpu/forward_times.py [float16|bfloat16]
    ncu ... python3 tests/gpu/forward_times.py one NAME[+VARIANT] [dtype]   # three calls of one row: profile the third

(forward + backward times per kernel: tests/gpu/backward_times.py, tests/gpu/kernel_times.py)
"""
import sys

import torch

import sdpa_math

SHAPES = {  # B, Hq, Hkv, L, S, E, causal
    "prefill1k_d64": (4, 16, 16, 1024, 1024, 64, False),
    "prefill1k_d128": (4, 16, 16, 1024, 1024, 128, False),
    "prefill2k_d128_causal": (2, 16, 16, 2048, 2048, 128, True),
    "gqa1k_d128": (4, 32, 8, 1024, 1024, 128, False),
    "tail100_d64": (8, 16, 16, 100, 1100, 64, False),
    # P's rows 8- and 4-byte aligned (S % 8 != 0): no TMA store, the warpgroup copies P out
    "prefill1k_d128_s1020": (4, 16, 16, 1024, 1020, 128, False),
    "prefill1k_d64_s1022": (4, 16, 16, 1024, 1022, 64, False),
    # odd S: P's rows 2-byte aligned (pair and 2-byte stores from the copy kernels)
    "prefill1k_d128_s1023": (4, 16, 16, 1024, 1023, 128, False),
    "long4k_d128_causal": (1, 32, 32, 4096, 4096, 128, True),
    "decode_s2k_d128": (32, 32, 32, 1, 2048, 128, False),
    "decode_s32k_d128_gqa": (2, 32, 8, 1, 32768, 128, False),
}


def median_ms(fn, reps=30):
    """GPU time of one call: a spin kernel (about 1 ms) is queued before the start event, so the
    host's work of issuing the call is hidden and the events measure the GPU's work alone (the
    benchmark's `--timing gpu`)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def qkv(name, dtype):
    """Contiguous random q, k, v of a shape of SHAPES."""
    B, H, Hkv, L, S, E, _ = SHAPES[name]
    q = torch.randn(B, H, L, E, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v


def variants(name, q, k, v, dtype):
    """The inputs of a shape's rows: unmasked, and on prefill1k_d128 its masked and transposed
    variants, by row suffix."""
    rows = {"": (q, k, v, None)}
    if name == "prefill1k_d128":
        B, _, L, _ = q.shape
        S = k.shape[2]
        pad = torch.zeros(B, 1, L, S, device="cuda", dtype=dtype)
        pad[..., S - 100:] = torch.finfo(dtype).min
        keypad = torch.ones(B, 1, 1, S, device="cuda", dtype=torch.bool)
        keypad[..., S - 100:] = False
        # Hugging Face's causal-and-padding mask as one (B, 1, L, S) bool tensor, the last 100 keys padded
        ar = torch.arange(S, device="cuda")
        hf = ((ar <= torch.arange(L, device="cuda")[:, None]) & (ar < S - 100)).expand(B, 1, L, S).contiguous()
        t = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731 (B, L, H, E) storage
        rows.update({"+fmask": (q, k, v, pad), "+keypad": (q, k, v, keypad), "+hfmask": (q, k, v, hf),
                     "+blhe": (t(q), t(k), t(v), None)})
    return rows


def one(row, dtype):
    """Three forward calls of one row (a shape, or shape+variant), for Nsight Compute's --launch-skip 2."""
    name, _, suffix = row.partition("+")
    _, H, Hkv, _, _, _, causal = SHAPES[name]
    q, k, v, m = variants(name, *qkv(name, dtype), dtype)["+" + suffix if suffix else ""]
    for _ in range(3):
        sdpa_math.attention(q, k, v, m, 0.0, causal, enable_gqa=H != Hkv)
    torch.cuda.synchronize()


def main():
    if sys.argv[1:2] == ["one"]:
        one(sys.argv[2], getattr(torch, sys.argv[3]) if len(sys.argv) > 3 else torch.float16)
        return
    dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else torch.float16
    for name, (B, H, Hkv, L, S, E, causal) in SHAPES.items():
        gqa = H != Hkv
        for suffix, (qq, kk, vv, m) in variants(name, *qkv(name, dtype), dtype).items():
            ms = median_ms(lambda: sdpa_math.attention(qq, kk, vv, m, 0.0, causal, enable_gqa=gqa))
            p_bytes = B * H * L * S * qq.element_size()
            print(f"{name + suffix:28s} {ms:8.3f} ms   P write alone at 4.2 TB/s: {p_bytes / 4.2e9:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
