"""Diagnostics of the Hopper backward on one GPU: where gradients differ from float64 (per batch,
head, row/key), and the CUDA kernel times of one backward on the anchor shapes (profiler)."""
import sys

import torch

import sdpa_math

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernel_times import kernel_ms  # noqa: E402

aten_math = torch.ops.aten._scaled_dot_product_attention_math


def where_wrong(dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(7)
    B, Hq, Hkv, L, S, E = 2, 4, 2, 150, 334, 128
    mk = lambda h, n: torch.randn(B, n, h, E, generator=gen, device="cuda").to(dtype).transpose(1, 2).detach().requires_grad_()  # noqa
    q, k, v = mk(Hq, L), mk(Hkv, S), mk(Hkv, S)
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda")
    for b in range(B):
        keep[b, ..., S - 7 * (b + 1):] = False
    g_out = torch.randn(B, Hq, L, E, generator=gen, device="cuda").to(dtype)
    g_p = torch.randn(B, Hq, L, S, generator=gen, device="cuda").to(dtype)
    for name, mask in (("bool_keypad", keep), ("as_float", torch.zeros(B, 1, 1, S, device="cuda", dtype=dtype).masked_fill(~keep, float("-inf")))):
        out, p = sdpa_math.attention(q, k, v, mask, enable_gqa=True)
        ours = torch.autograd.grad((out, p), (q, k, v), (g_out, g_p))
        x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
        m64 = mask if mask.dtype == torch.bool else mask.double()
        o64, p64 = aten_math(*x64, attn_mask=m64, enable_gqa=True)
        ref = torch.autograd.grad((o64, p64), x64, (g_out.double(), g_p.double()))
        print(name, "P err", (p.double() - p64).abs().max().item(), "O err", (out.double() - o64).abs().max().item())
        for n, a, r in zip("qkv", ours, ref):
            d = (a.double() - r).abs()
            print(f"  d{n}: rel {(d.norm() / r.norm()).item():.2e}; per (b, h) max:", d.amax(dim=(-1, -2)).flatten().tolist())
            idx = d.argmax()
            print("     worst at", [int(i) for i in torch.unravel_index(idx, d.shape)], "rows/keys with err > 1e-2:",
                  (d.amax(-1) > 1e-2).nonzero()[:8].tolist())


def kernel_times(dtype=torch.float16):
    for name, (B, H, L, E, causal) in {"prefill1k_d128": (4, 16, 1024, 128, False), "prefill1k_d64": (4, 16, 1024, 64, False),
                                       "prefill2k_causal": (2, 16, 2048, 128, True)}.items():
        q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        g_out = torch.randn(B, H, L, E, device="cuda", dtype=dtype)
        g_p = torch.randn(B, H, L, L, device="cuda", dtype=dtype)
        for which in ("O,P", "O"):
            def step():
                out, p = sdpa_math.attention(q, k, v, None, 0.0, causal)
                if which == "O":
                    torch.autograd.grad(out, (q, k, v), g_out)
                else:
                    torch.autograd.grad((out, p), (q, k, v), (g_out, g_p))
            times = kernel_ms(step)  # (kernel, ms) longest first
            print(f"{name} grads through {which}: " + ", ".join(f"{k} {v:.3f}" for k, v in times[:7]))


if __name__ == "__main__":
    what = sys.argv[1:] or ["where", "times"]
    if "one" in what:  # a few backward calls of prefill1k_d128 through O, for ncu
        q, k, v = (torch.randn(4, 16, 1024, 128, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        for _ in range(3):
            out, _ = sdpa_math.attention(q, k, v)
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    if "where" in what:
        where_wrong()
    if "times" in what:
        kernel_times()
