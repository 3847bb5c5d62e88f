"""A few forward+backward calls of every CUDA kernel family, small enough to run under
compute-sanitizer (memcheck, racecheck, synccheck, initcheck): tails in L and S, padded head sizes, masks, causal,
GQA, dropout, strided inputs, fp16/bf16 (tensor cores), a few query rows (the decode path),
fp32/fp64 (generic path), the Hopper statistics kernel, and kl_to's kernels (kl_forward, kl_rows, the Hopper
backward's KL form; its forward's O and lse come from PyTorch's SDPA kernel where one applies).

    compute-sanitizer --tool memcheck python3 tests/gpu/sanitize_cases.py [kl|decode]

(`kl`: only kl_to's calls; `decode`: only the decode path's.)
"""
import sys

import torch

import sdpa_math
from sdpa_math.stats import attention_stats


def run(dtype, B, Hq, Hkv, L, S, E, Ev, causal=False, mask=None, dropout=0.0, transposed=False, blhe=False):
    gen = torch.Generator(device="cuda").manual_seed(L * 1000 + S)

    def t(*shape):
        if blhe:  # (B, L, H, E) storage viewed as (B, H, L, E), as Hugging Face modules pass it
            b, h, n, e = shape
            return torch.randn(b, n, h, e, device="cuda", dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(True)
        if transposed:
            x = torch.randn(*shape[:-2], shape[-1], shape[-2], device="cuda", dtype=dtype, generator=gen)
            return x.transpose(-1, -2).requires_grad_(True)
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)

    q, k, v = t(B, Hq, L, E), t(B, Hkv, S, E), t(B, Hkv, S, Ev)
    m = None
    if mask == "float":
        m = torch.randn(B, 1, L, S, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
    elif mask == "float_pad":  # (B, 1, L, S) float, 0 or the dtype's min on the last 100 keys (Hugging Face's padding)
        m = torch.zeros(B, 1, L, S, device="cuda", dtype=dtype)
        m[..., S - 100:] = torch.finfo(dtype).min
        m.requires_grad_(True)
    elif mask == "bool":
        m = torch.rand(L, S, device="cuda", generator=gen) < 0.7
        m[1] = False
    elif mask == "keypad":  # (B, 1, 1, S), batch b's last b * S / 2 keys hidden (whole tiles skipped)
        m = (torch.arange(S, device="cuda") < S - torch.arange(B, device="cuda")[:, None] * S // 2)[:, None, None]
    elif mask == "causal_pad":  # (B, 1, L, S) bool, causal and padding in one (Hugging Face's): rows scanned
        keys = torch.arange(S, device="cuda")
        valid = S - torch.arange(B, device="cuda") * S // 2
        m = ((keys <= torch.arange(L, device="cuda")[:, None]) & (keys < valid[:, None, None]))[:, None].contiguous()
    out, probs = sdpa_math.attention(q, k, v, m, dropout, causal, enable_gqa=Hq != Hkv)
    leaves = [q, k, v] + ([m] if m is not None and m.is_floating_point() else [])
    torch.autograd.grad((out, probs), leaves, (torch.randn_like(out), torch.randn_like(probs)))
    # and each output alone (the dO-only and dP-only paths)
    out, probs = sdpa_math.attention(q, k, v, m, dropout, causal, enable_gqa=Hq != Hkv)
    torch.autograd.grad(out, leaves, torch.randn_like(out), retain_graph=True)
    torch.autograd.grad(probs, leaves, torch.randn_like(probs))


def stats(dtype, B, Hq, Hkv, L, S, E, Ev, causal=False, mask=False, rows=None, cols=True, entropy=True):
    """The Hopper statistics kernel (column sums, entropy, a rows window) and its column pass;
    without column sums (cols=False), its one-pass CTAs; rows alone (cols=False, entropy=False, a
    short window), the softmax_rows kernel. Up to 4 rows (L <= 4): the decode kernels."""
    gen = torch.Generator(device="cuda").manual_seed(L * 1000 + S + 1)
    q, k, v = (torch.randn(B, h, n, e, device="cuda", dtype=dtype, generator=gen)
               for h, n, e in ((Hq, L, E), (Hkv, S, E), (Hkv, S, Ev)))
    m = None
    if mask:
        m = torch.rand(L, S, device="cuda", generator=gen) < 0.7
        m[1] = False
    # auto: the kernel on Hopper, the chunks when it is off (SDPA_MATH_SM90=0)
    attention_stats(q, k, v, m, is_causal=causal, enable_gqa=Hq != Hkv, col_sum="per_head" if cols else None,
                    row_entropy=entropy, rows=rows)


def kl(dtype, B, Hq, Hkv, L, S, E, causal=False):
    """kl_to alone with a gradient: on Hopper the fused path (kl_forward's kernel from 128 query rows
    where TMA reads the reference, else r K and kl_rows; the KL backward form)."""
    gen = torch.Generator(device="cuda").manual_seed(L * 1000 + S + 2)
    q, k, v = (torch.randn(B, h, n, E, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
               for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))
    r = torch.softmax(torch.randn(B, Hq, L, S, device="cuda", generator=gen), -1)
    if causal:
        r = torch.softmax(torch.randn(B, Hq, L, S, device="cuda", generator=gen).masked_fill(
            torch.ones(L, S, dtype=torch.bool, device="cuda").triu(1), float("-inf")), -1)
    out, st = attention_stats(q, k, v, is_causal=causal, enable_gqa=Hq != Hkv, kl_to=r.to(dtype))
    torch.autograd.grad(st["kl_to"].sum() * 1e-4, (q, k))


def decode_cases(dtype):
    """The decode path (L <= 4): packed rows of K and V and the (B, L, H, E) view, masks,
    dropout, GQA groups, Ev != E, head 256."""
    run(dtype, 1, 2, 2, 3, 530, 200, 256, mask="float", dropout=0.2)
    run(dtype, 2, 4, 4, 2, 70, 64, 64, mask="bool")
    run(dtype, 1, 2, 2, 4, 300, 32, 32, causal=True)
    run(dtype, 2, 8, 2, 1, 600, 128, 128)                     # GQA, whole groups
    run(dtype, 1, 8, 1, 1, 300, 64, 64, mask="float")         # GQA, half groups
    run(dtype, 1, 4, 2, 2, 270, 16, 16, mask="bool")          # GQA, 2 heads x 2 rows
    run(dtype, 2, 4, 2, 1, 777, 64, 40, blhe=True)            # rows H * E apart
    run(dtype, 1, 2, 2, 1, 1100, 128, 128, blhe=True)
    # the statistics on the decode kernels (decode_stats after the finalize without P)
    stats(dtype, 2, 2, 2, 3, 77, 64, 64, rows=slice(1, None))
    stats(dtype, 2, 8, 2, 1, 600, 128, 128)                   # GQA, tensor cores
    stats(dtype, 1, 2, 2, 4, 300, 64, 64, causal=True, rows=slice(0, None, 2))
    stats(dtype, 1, 4, 4, 2, 5000, 64, 64, mask=True, cols=False)  # decode_finalize, 20 blocks


def main():
    if sys.argv[1:] == ["decode"]:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            decode_cases(dtype)
        torch.cuda.synchronize()
        print("sanitize_cases: the decode calls finished")
        return
    for dtype in (torch.float16, torch.bfloat16):
        kl(dtype, 1, 2, 2, 100, 136, 64)
        kl(dtype, 2, 4, 2, 130, 200, 128, causal=True)
        kl(dtype, 1, 2, 2, 1, 64, 80)
        kl(dtype, 2, 4, 2, 70, 90, 64, causal=True)  # 180-byte reference rows: r K, kl_rows, pairs
        kl(dtype, 1, 2, 2, 130, 392, 40, causal=True)  # kl_forward with key tiles no row sees
    if sys.argv[1:] == ["kl"]:
        torch.cuda.synchronize()
        print("sanitize_cases: kl_to's calls finished")
        return
    for dtype in (torch.float16, torch.bfloat16):
        stats(dtype, 1, 2, 2, 130, 200, 64, 64, rows=slice(-3, None))
        stats(dtype, 2, 4, 2, 190, 250, 128, 96, mask=True, rows=slice(1, None, 37))
        stats(dtype, 1, 2, 2, 257, 1100, 128, 128, causal=True, rows=slice(5, None, 37))
        stats(dtype, 2, 2, 2, 3, 77, 64, 64)
        stats(dtype, 2, 2, 2, 1, 600, 128, 128)
        stats(dtype, 2, 4, 2, 300, 250, 128, 96, mask=True, rows=slice(-2, None), cols=False)
        stats(dtype, 1, 2, 2, 257, 1100, 64, 64, causal=True, cols=False)
        stats(dtype, 1, 4, 2, 300, 1037, 64, 64, causal=True, rows=slice(-40, None, 3), cols=False, entropy=False)
        stats(dtype, 2, 2, 2, 2, 77, 128, 128, rows=slice(1, 2), cols=False, entropy=False)
    for dtype in (torch.float16, torch.bfloat16):
        run(dtype, 1, 2, 2, 70, 133, 64, 64)                               # sm90 on Hopper
        run(dtype, 2, 4, 2, 130, 200, 80, 80, blhe=True, causal=True)      # sm90: views, GQA, causal
        run(dtype, 2, 2, 2, 129, 140, 128, 96, mask="bool", blhe=True)     # sm90: bool mask, Ev != E
        run(dtype, 3, 2, 2, 200, 600, 64, 64, mask="keypad")               # sm90: padded key tiles skipped
        run(dtype, 2, 2, 2, 300, 640, 128, 128, mask="causal_pad")         # sm90: a per-row mask's scan
        run(dtype, 1, 2, 2, 40, 4200, 64, 64, mask="float")                # sm90: a mask plan of two words
        run(dtype, 2, 2, 2, 200, 700, 128, 128, mask="float_pad")          # sm90: neutral float-mask tiles (bf16: base 2)
        run(dtype, 1, 3, 1, 100, 1100, 64, 64)                             # sm90: P rows 8-byte aligned (copied out)
        run(dtype, 1, 2, 2, 130, 250, 128, 128, causal=True)               # sm90: P rows 4-byte aligned (copied out)
        run(dtype, 1, 2, 2, 130, 201, 64, 64, causal=True)                 # sm90: odd S, P rows 2-byte aligned
        run(dtype, 1, 3, 3, 70, 129, 64, 64)                               # sm90: odd S, a last tile of one key
        run(dtype, 1, 2, 2, 65, 65, 128, 128, causal=True)
        run(dtype, 2, 4, 2, 33, 47, 96, 96, mask="float")
        run(dtype, 1, 2, 2, 17, 90, 256, 256, mask="bool", dropout=0.2)
        run(dtype, 1, 2, 2, 20, 30, 40, 24, transposed=True)
        run(dtype, 1, 2, 1, 1, 300, 128, 128)
        decode_cases(dtype)
    for dtype in (torch.float32, torch.float64):
        run(dtype, 1, 2, 2, 9, 13, 20, 12, mask="float")
        run(dtype, 1, 2, 1, 8, 11, 16, 16, causal=True, dropout=0.3)
    run(torch.float32, 1, 2, 1, 1, 300, 64, 64)  # decode path
    run(torch.float32, 2, 4, 2, 33, 47, 40, 24)                                # cuBLAS path, GQA stacked
    run(torch.float32, 1, 2, 2, 65, 65, 64, 64, causal=True)                   # cuBLAS path
    run(torch.float32, 2, 2, 2, 30, 70, 32, 32, mask="bool", dropout=0.2)      # cuBLAS forward
    torch.cuda.synchronize()
    print("sanitize_cases: all calls finished")


if __name__ == "__main__":
    main()
