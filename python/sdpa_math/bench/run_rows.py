"""One row of `bench run`: every implementation's error against float64, its override check and
peak memory, then the times of all of them interleaved, forward and forward + backward."""
from __future__ import annotations

import dataclasses
import math

import torch

import sdpa_math

from .implementations import Impls, additive_mask, aten_math
from .shapes import VARIANTS, Shape, make_inputs
from .timing import floor_ms, interleaved_ms, output_bytes, peak_extra_bytes


def _rel(a, b):
    """Relative Frobenius error of a against the reference b, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_row(impls: Impls, s: Shape, dtype, device, ceil, reps, with_backward=True):
    q, k, v, mask = make_inputs(s, dtype, device)
    scale = 1.0 / math.sqrt(s.D)
    row = {"shape": s.name, "dtype": str(dtype).split(".")[-1], **dataclasses.asdict(s),
           "variant_of": s.base_name() if s.variant else None, "inputs": VARIANTS.get(s.variant, "contiguous, no mask"),
           "floor": floor_ms(s, dtype, ceil), "output_bytes": output_bytes(s, dtype), "impls": {}}
    ref_mask = None if mask is None else additive_mask(mask, torch.float64).double()
    ref_out, ref_probs = aten_math(q.double(), k.double(), v.double(), ref_mask, 0.0, s.causal, scale=scale,
                                   enable_gqa=s.Hq != s.Hkv)
    gen = torch.Generator(device=device).manual_seed(1)
    g_out = torch.randn(ref_out.shape, generator=gen, device=device, dtype=dtype)
    g_probs = torch.randn(ref_probs.shape, generator=gen, device=device, dtype=dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]  # the same layout as q, k, v

    def make_fwd(name):
        def fwd():
            with torch.no_grad():
                return impls.call(name, q, k, v, s, scale, mask)
        return fwd

    def make_fwdbwd(name):
        def fwdbwd():
            res = impls.call(name, *leaves, s, scale, mask)
            if name == "flash":
                return torch.autograd.grad(res, leaves, g_out)
            return torch.autograd.grad(res, leaves, (g_out, g_probs))
        return fwdbwd

    # Correctness, the override check and memory per implementation first; then the times of all
    # of them interleaved, forward and forward+backward.
    for name in impls.names(dtype):
        r = row["impls"][name] = {}
        try:
            before = sdpa_math.interceptions()
            with torch.no_grad():
                res = impls.call(name, q, k, v, s, scale, mask)
            if name == "override":
                r["override_took_call"] = sdpa_math.interceptions() == before + 1
            out, probs = (res, None) if name == "flash" else res
            r["rel_err_o"] = _rel(out, ref_out)
            r["rel_err_p"] = None if probs is None else _rel(probs, ref_probs)
            del res, out, probs
            r["peak_extra_bytes"] = peak_extra_bytes(make_fwd(name), device)
            if with_backward:
                r["fwdbwd_peak_extra_bytes"] = peak_extra_bytes(make_fwdbwd(name), device)
        except Exception as e:  # a failing alternative is recorded, not fatal
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    ok = [n for n, r in row["impls"].items() if "error" not in r]
    phases = [("fwd", make_fwd)] + ([("fwdbwd", make_fwdbwd)] if with_backward else [])
    for phase, make in phases:
        host = {}
        timed, errors = interleaved_ms({n: make(n) for n in ok}, device, reps=reps, host=host)
        for n, (median, samples) in timed.items():
            row["impls"][n][f"{phase}_ms"], row["impls"][n][f"{phase}_samples"] = median, samples
            row["impls"][n][f"{phase}_host_ms"] = host[n]
        for n, err in errors.items():
            row["impls"][n]["error"] = err
    ours = row["impls"].get("ours", {})
    row["speedup"] = {}
    for phase in ("fwd_ms", "fwdbwd_ms"):
        if phase not in ours:
            continue
        row["speedup"][phase] = {n: r[phase] / ours[phase] for n, r in row["impls"].items()
                                 if n != "ours" and phase in r}
        row["speedup"][phase]["floor"] = row["floor"][phase] / ours[phase]
    return row
