"""Seeded random problems, then every bad input, in one process, on the CPU and on CUDA.

Each problem draws its shape (batch dims, heads with GQA, rows, keys, head sizes with Ev != E),
layout (contiguous, transposed, sliced), mask (none, bool or float in every broadcast form, rows
fully masked), causal, explicit dropout, scale and dtype from one seed, runs the forward and the
backward through both outputs, and compares O, P, dQ, dK, dV (and a float mask's gradient) with
PyTorch's math op run in float64 on the same (rounded) inputs. After the problems, the contract's
bad inputs each raise a RuntimeError on the same device. A crash anywhere ends the process, and the
test with it. Output buffers start as NaN (SDPA_MATH_POISON_OUTPUTS=1): an element no kernel
writes fails the comparison.
"""
import os
import random

import pytest
import torch

import sdpa_math
from cases import Case, build

PROBLEMS = int(os.environ.get("SDPA_MATH_FUZZ_PROBLEMS", "200"))  # fewer under compute-sanitizer
# Problems before FIRST are drawn (so each problem n is the same) but not run; VERBOSE prints each
# problem before it runs, so a sanitizer's report can be placed.
FIRST = int(os.environ.get("SDPA_MATH_FUZZ_FIRST", "0"))
VERBOSE = os.environ.get("SDPA_MATH_FUZZ_VERBOSE", "0") == "1"
MASKS = ["none", "float", "float_pad", "float_2d", "bool", "bool_pad", "bool_rows", "neginf_rows", "fmin_rows"]
DEVICE_DTYPES = {"cpu": [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                 "cuda": [torch.float16, torch.bfloat16, torch.float32, torch.float64]}
# (rtol, atol) against float64: O and P, and the gradients' relative Frobenius error (with atol
# scaled by sqrt(n) as in test_cuda.py). fp16/bf16 round P, O, dS and the weights once each.
FORWARD_TOL = {torch.float64: (1e-9, 1e-11), torch.float32: (1e-4, 1e-5), torch.float16: (4e-3, 1e-4),
               torch.bfloat16: (3e-2, 1e-3)}
GRAD_TOL = {torch.float64: (1e-8, 1e-11), torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 5e-3),
            torch.bfloat16: (6e-2, 4e-2)}


def draw_case(rng):
    """One problem of the contract's space, small enough for hundreds in a CPU test."""
    hkv = rng.choice([1, 2, 3])
    group = rng.choice([1, 1, 2, 4])
    L = rng.choice([1, 2, 3, 4, rng.randint(5, 70)])  # a third decode-sized
    S = rng.choice([1, rng.randint(2, 40), rng.randint(41, 300)])
    E = rng.choice([1, 8, 16, 24, 32, 40, 64, 80, 96, 128])
    Ev = E if rng.random() < 0.7 else rng.choice([8, 16, 64, 128])
    mask = rng.choice(MASKS)
    causal = mask == "none" and rng.random() < 0.3
    dropout = rng.choice(["none", "none", "none", "explicit_bool", "explicit_float"])
    if dropout != "none" and mask in ("neginf_rows", "fmin_rows"):
        dropout = "none"
    return Case(batch=rng.choice([(), (1,), (2,), (2, 2)]), hq=hkv * group, hkv=hkv, gqa=group > 1, L=L, S=S, E=E,
                Ev=Ev, mask=mask, causal=causal, dropout=dropout,
                layout=rng.choice(["contig", "contig", "transposed", "sliced"]),
                scale=rng.choice([None, None, 0.5, -0.3]))


def reference(args, kwargs, float_mask):
    """The math op in float64 on the same (rounded) inputs: a bool mask as the public API turns
    it into an additive one (contract §5)."""
    q, k, v, mask, p, causal, dmask = (t.detach().cpu().double() if torch.is_tensor(t) and t.is_floating_point()
                                        else (t.cpu() if torch.is_tensor(t) else t) for t in args)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    leaves = [t.requires_grad_(True) for t in (q, k, v)] + ([mask.requires_grad_(True)] if float_mask else [])
    out, probs = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, p, causal, dmask, **kwargs)
    return out, probs, leaves


def rel_err(a, b, atol):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / (b.norm() + atol * b.numel() ** 0.5)).item()


def check_problem(case, dtype, seed, device):
    args, kwargs = build(case, dtype, seed=seed, device=device)
    q, k, v, mask, p, causal, dmask = args
    float_mask = mask is not None and mask.is_floating_point()
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    m = mask.detach().clone().requires_grad_(True) if float_mask else mask
    out, probs = sdpa_math.attention(*leaves, m, p, causal, dmask, **kwargs)
    ref_out, ref_probs, ref_leaves = reference(args, kwargs, float_mask)
    rtol, atol = FORWARD_TOL[dtype]
    scale_v = max(v.abs().max().item(), 1.0)
    torch.testing.assert_close(probs.cpu().double(), ref_probs.detach(), rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(out.cpu().double(), ref_out.detach(), rtol=rtol, atol=atol * scale_v * 10,
                               equal_nan=True)

    gen = torch.Generator().manual_seed(seed + 1)
    g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    g_probs = torch.randn(probs.shape, generator=gen, dtype=torch.float64)
    wrt = leaves + ([m] if float_mask else [])
    got = torch.autograd.grad((out, probs), wrt, (g_out.to(out), g_probs.to(probs)))
    # The reference takes the cotangents as our op receives them: rounded to the dtype.
    ref = torch.autograd.grad((ref_out, ref_probs), ref_leaves,
                              (g_out.to(out.dtype).double(), g_probs.to(probs.dtype).double()))
    # A gradient that is zero by construction (one key: dS = P (dP - delta) = 0, so dQ, dK and the
    # mask's are 0 in float64) is rounding residue here, of the size of the products that cancel
    # (dO . O over Ev terms, times the dropout scale), which no relative test bounds (seen on the
    # H200: fp32 5e-6 per element, 0.3 eps·mag). Such gradients are held to 4·eps·mag·|dO|max per
    # element instead, mag being that magnitude with the largest |q|, |k|, |v|: far below the O(mag)
    # that a wrong formula gives.
    mag = max(1.0, *(t.abs().max().item() for t in (q, k, v) if t.numel())) ** 2 * max(case.E, case.Ev) ** 0.5
    mag /= 1.0 - (p if case.dropout != "none" else 0.0)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), got, ref):
        g_rtol, g_atol = max(GRAD_TOL[dtype], GRAD_TOL.get(a.dtype, GRAD_TOL[dtype]))
        g_atol *= mag
        assert torch.isfinite(a).all() == torch.isfinite(b).all(), name
        a, b = torch.nan_to_num(a).detach().cpu().double(), torch.nan_to_num(b).detach().cpu().double()
        if b.numel() and b.abs().max().item() <= 1e-12 * mag:
            residue = a.abs().max().item() / (torch.finfo(dtype).eps * mag * max(1.0, g_out.abs().max().item()))
            assert residue <= 4.0, (name, "zero gradient's residue / (eps·mag·|dO|max)", residue)
        else:
            err = rel_err(a, b, g_atol)
            assert err <= g_rtol, (name, err)


def bad_inputs(device):
    """(callable, message fragment) for each bad input of the contract on `device`."""
    t = lambda *s, dtype=torch.float32: torch.randn(*s, device=device).to(dtype)  # noqa: E731
    q, k, v = t(2, 4, 6, 8), t(2, 4, 7, 8), t(2, 4, 7, 8)
    k3, v3 = t(2, 3, 7, 8), t(2, 3, 7, 8)
    k2, v2 = t(2, 2, 7, 8), t(2, 2, 7, 8)
    att = sdpa_math.attention
    cases = [
        (lambda: att(q, k3, v3, enable_gqa=True), "must divide the number of heads in query"),
        (lambda: att(q, k2, v2), "pass enable_gqa=True"),
        (lambda: att(q, k, v, torch.zeros(6, 7, device=device), 0.0, True), "should not be set when is_causal=True"),
        (lambda: att(q, k, v, None, 1.5), "dropout probability has to be between 0 and 1"),
        (lambda: att(q, k.double(), v), "to have the same dtype"),
        (lambda: att(q, k, v, torch.zeros(6, 7, device=device, dtype=torch.float64)), "attn_mask dtype"),
        (lambda: att(q.long(), k.long(), v.long()), "query has dtype int64"),
        (lambda: att(q[0, 0, 0], k, v), "at least 2 dimensions"),
        (lambda: att(q, k, v, None, 0.5, False, torch.ones(3, 3, dtype=torch.bool, device=device)), "does not match"),
        (lambda: att(q, t(2, 4, 7, 9), v), None),       # E of key != E of query
        (lambda: att(q, k, t(2, 4, 8, 8)), None),       # S of value != S of key
        (lambda: att(q, k, v, torch.zeros(5, 7, device=device)), None),  # mask not broadcastable
        (lambda: att(q, t(3, 4, 7, 8), t(3, 4, 7, 8)), None),  # batch not broadcastable
    ]
    if device == "cuda":
        cases.append((lambda: att(q, k.cpu(), v), None))  # tensors on two devices
    return cases


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
def test_fuzz_problems_then_bad_inputs(device, monkeypatch):
    monkeypatch.setenv("SDPA_MATH_POISON_OUTPUTS", "1")
    rng = random.Random(20261201 + (device == "cuda"))
    done, failures = 0, []
    for n in range(PROBLEMS):
        case = draw_case(rng)
        dtype = rng.choice(DEVICE_DTYPES[device])
        if n < FIRST:
            continue
        if VERBOSE:
            print(f"problem {n}: {case} {dtype}", flush=True)
        try:
            check_problem(case, dtype, seed=n, device=device)
        except AssertionError as e:  # every mismatch is reported, not only the first
            failures.append(f"problem {n}: {case} {dtype}: {e}")
        done += 1
    for fn, message in bad_inputs(device):
        with pytest.raises(RuntimeError) as info:
            fn()
        if message is not None:
            assert message in str(info.value)
    # The device is still usable after the errors.
    out, probs = sdpa_math.attention(*(torch.ones(1, 1, 2, 8, device=device) for _ in range(3)))
    assert torch.allclose(probs.cpu(), torch.full((1, 1, 2, 2), 0.5))
    print(f"fuzz on {device}: {done} problems and {len(bad_inputs(device))} bad inputs without a crash, "
          f"{len(failures)} mismatches")
    assert not failures, "\n".join(failures)
