"""The semantics probe: re-checks every *observed* line of docs/contract.md against the
installed PyTorch and prints a table. It is the evidence for sdpa_math's semantics and an early
warning when PyTorch changes. Exit status 1 when an observation no longer holds.

    python -m sdpa_math.probe [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import sys

import torch

aten_math = torch.ops.aten._scaled_dot_product_attention_math


def _qkv(*shape_q, S=6, Ev=None, Hkv=None, dtype=torch.float64, device="cpu"):
    *lead, L, E = shape_q
    klead = list(lead)
    if Hkv is not None:
        klead[-1] = Hkv
    q = torch.randn(*lead, L, E, dtype=dtype, device=device)
    k = torch.randn(*klead, S, E, dtype=dtype, device=device)
    v = torch.randn(*klead, S, Ev or E, dtype=dtype, device=device)
    return q, k, v


def _softmax_ref(q, k, v, mask=None, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * q @ k.transpose(-2, -1)
    if mask is not None:
        s = s + mask
    a = torch.softmax(s, -1)
    return a @ v, a


def _raises(fn, text):
    try:
        fn()
    except RuntimeError as e:
        return text in str(e), str(e).splitlines()[0][:90]
    return False, "no error"


def observations(device="cpu"):
    """(contract line, holds?, detail) for each observed line."""
    d = dict(device=device)
    out = []

    q, k, v = _qkv(3, 5, 8, **d)
    o, p = aten_math(q, k, v)
    out.append(("3-D inputs work", o.shape == (3, 5, 8), str(tuple(o.shape))))
    q, k, v = _qkv(2, 2, 2, 5, 8, **d)
    o, p = aten_math(q, k, v)
    out.append(("5-D inputs work", o.shape == (2, 2, 2, 5, 8), str(tuple(o.shape))))
    q, k, v = _qkv(2, 3, 5, 8, Ev=4, **d)
    o, p = aten_math(q, k, v)
    out.append(("Ev != E works", o.shape == (2, 3, 5, 4), str(tuple(o.shape))))

    q, k, v = _qkv(2, 3, 5, 8, **d)
    for shape in [(2, 1, 1, 6), (5, 6)]:
        m = torch.randn(shape, dtype=q.dtype, device=device)
        o, p = aten_math(q, k, v, m)
        ro, rp = _softmax_ref(q, k, v, m)
        out.append((f"mask {shape} broadcasts", torch.allclose(p, rp), f"max err {(p - rp).abs().max().item():.1e}"))

    for dt in (torch.float16, torch.bfloat16):
        q, k, v = _qkv(2, 3, 5, 8, dtype=dt, **d)
        o, p = aten_math(q, k, v)
        out.append((f"outputs keep query dtype ({dt})", o.dtype == dt and p.dtype == dt, f"{o.dtype}, {p.dtype}"))
    if hasattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed"):
        allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
        out.append(("fp16/bf16 reduction in math SDP off by default", allowed is False, str(allowed)))

    q, k, v = _qkv(2, 3, 5, 8, **d)
    o, p = aten_math(q, k, v, scale=-0.5)
    ro, rp = _softmax_ref(q, k, v, scale=-0.5)
    out.append(("negative scale flips the scores", torch.allclose(p, rp), f"max err {(p - rp).abs().max().item():.1e}"))

    q, k, v = _qkv(1, 1, 4, 8, S=7, **d)
    o, p = aten_math(q, k, v, is_causal=True)
    tl = torch.ones(4, 7, dtype=torch.bool, device=device).tril()
    out.append(("causal is top-left when L != S", bool((p[0, 0][~tl] == 0).all()) and bool((p[0, 0][tl] > 0).all()), ""))
    ok, msg = _raises(lambda: aten_math(q, k, v, torch.zeros(4, 7, dtype=q.dtype, device=device), is_causal=True),
                      "Explicit attn_mask should not be set when is_causal=True")
    out.append(("causal + mask is an error", ok, msg))

    q, k, v = _qkv(1, 2, 4, 8, **d)
    m = torch.randn(1, 1, 4, 6, dtype=q.dtype, device=device, requires_grad=True)
    o, p = aten_math(q, k, v, m)
    (o.sum() + p.square().sum()).backward()
    out.append(("a float mask that requires grad gets a gradient", m.grad is not None and m.grad.shape == m.shape, ""))

    q, k, v = _qkv(1, 2, 4, 8, **d)
    bm = torch.rand(4, 6, device=device) > 0.5
    o, p = aten_math(q, k, v, bm)
    ro, rp = _softmax_ref(q, k, v, bm.to(q.dtype))
    out.append(("direct call with a bool mask ADDS 0/1 (the quirk)", torch.allclose(p, rp), "sdpa_math diverges: True = attend"))

    q, k, v = _qkv(1, 2, 4, 8, **d)
    q.requires_grad_(True)
    m = torch.zeros(4, 6, dtype=q.dtype, device=device)
    m[1] = float("-inf")
    o, p = aten_math(q, k, v, m)
    (o.sum() + p.sum()).backward()
    out.append(("fully masked row: P = O = 0, finite grads",
                bool((p[:, :, 1] == 0).all() and (o[:, :, 1] == 0).all() and torch.isfinite(q.grad).all()), ""))
    q, k, v = _qkv(1, 2, 4, 8, **d)
    m = torch.full((4, 6), torch.finfo(q.dtype).min, dtype=q.dtype, device=device)
    o, p = aten_math(q, k, v, m)
    out.append(("finfo.min row is not fully masked (uniform)", torch.allclose(p, torch.full_like(p, 1 / 6)), ""))

    q, k, v = _qkv(1, 2, 4, 8, **d)
    dm = torch.rand(1, 2, 4, 6, device=device) > 0.5
    o0, p0 = aten_math(q, k, v)
    o1, p1 = aten_math(q, k, v, dropout_p=0.0, dropout_mask=dm)
    out.append(("dropout_p = 0 ignores dropout_mask", torch.equal(p0, p1) and torch.equal(o0, o1), ""))
    for kind, mask in (("bool", dm), ("float", dm.to(q.dtype))):
        o, p = aten_math(q, k, v, dropout_p=0.25, dropout_mask=mask)
        holds = torch.allclose(p, p0 * dm) and torch.allclose(o, (p0 * dm) @ v / 0.75)
        out.append((f"explicit {kind} dropout mask: P = A*M, O = (A*M)V/(1-p)", holds, ""))
    torch.manual_seed(0)
    o, p = aten_math(q, k, v, dropout_p=0.25)
    kept = p != 0
    holds = torch.allclose(p[kept], p0[kept] / 0.75) and torch.allclose(o, p @ v)
    out.append(("random dropout: P = dropout(A) (kept scaled), O = P V", holds, f"kept {kept.double().mean().item():.2f}"))
    torch.manual_seed(0)
    o2, p2 = aten_math(q, k, v, dropout_p=0.25)
    out.append(("random dropout reproducible under manual_seed", torch.equal(p, p2), ""))
    o, p = aten_math(q, k, v, dropout_p=1.0)
    out.append(("random dropout p = 1 gives zeros", bool((p == 0).all() and (o == 0).all()), ""))
    o, p = aten_math(q, k, v, dropout_p=1.0, dropout_mask=dm)
    out.append(("explicit mask p = 1: P = A*M, O non-finite (1/(1-p))", torch.allclose(p, p0 * dm) and not bool(torch.isfinite(o).all()), ""))

    q, k, v = _qkv(2, 6, 4, 8, Hkv=2, **d)
    o, p = aten_math(q, k, v, enable_gqa=True)
    ro, rp = aten_math(q, k.repeat_interleave(3, -3), v.repeat_interleave(3, -3))
    out.append(("GQA = repeat_interleave of key/value heads", torch.allclose(p, rp) and torch.allclose(o, ro), ""))
    q, k, v = _qkv(2, 6, 4, 8, Hkv=4, **d)
    ok, msg = _raises(lambda: aten_math(q, k, v, enable_gqa=True), "Number of heads in key and value must divide")
    out.append(("GQA heads not dividing is an error", ok, msg))
    q, k, v = _qkv(2, 6, 4, 8, Hkv=2, **d)
    ok, msg = _raises(lambda: aten_math(q, k, v), "must match")
    out.append(("mismatched heads without GQA is an error", ok, msg))
    q, k, v = _qkv(2, 6, 4, 8, Hkv=1, **d)
    o, p = aten_math(q, k, v)
    out.append(("a single key/value head broadcasts without GQA", o.shape == (2, 6, 4, 8), str(tuple(o.shape))))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdpa_math.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(1234)
    rows = observations(args.device)
    width = max(len(r[0]) for r in rows)
    print(f"PyTorch {torch.__version__}, device {args.device}")
    for name, holds, detail in rows:
        print(f"{'holds ' if holds else 'CHANGED'}  {name:<{width}}  {detail}")
    changed = sum(not r[1] for r in rows)
    print(f"{len(rows) - changed} of {len(rows)} observations hold")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
