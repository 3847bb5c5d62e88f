"""One row of `bench stats` (issue 16): the statistics-only forward (column sums and row entropy
per head, no gradient) by each implementation, its error against float64 and peak memory, and
the distillation term's forward + backward (run_kl)."""
from __future__ import annotations

import dataclasses
import math

import torch

from .implementations import aten_math, kl_impls
from .run_rows import _rel
from .shapes import Shape, make_inputs
from .timing import interleaved_ms, peak_extra_bytes


def run_kl(s: Shape, dtype, device, reps, q, k, v, scale):
    """Forward + backward times of kl_impls on one shape, and ours' ratio to flash; the reference
    map is another head's softmax (a teacher), in the inputs' dtype."""
    q_ref = torch.randn(q.shape, generator=torch.Generator(device=device).manual_seed(5), device=device, dtype=dtype)
    with torch.no_grad():
        _, ref = aten_math(q_ref, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    fns = {name: (lambda f=f: f(*leaves, ref, s, scale)) for name, f in kl_impls().items()}
    times, errors = interleaved_ms(fns, device, reps=reps)
    ms = {name: t for name, (t, _) in times.items()}
    out = {"ms": ms, "errors": errors}
    if ms.get("flash") and ms.get("ours"):
        out["x_flash"] = ms["ours"] / ms["flash"]
    return out


def run_stats_row(impls, s: Shape, dtype, device, reps):
    q, k, v, _ = make_inputs(s, dtype, device)
    scale = 1.0 / math.sqrt(s.D)
    row = {"shape": s.name, "dtype": str(dtype).split(".")[-1], **dataclasses.asdict(s)}
    # Whether "ours" ran the fused operator (always on the CPU; on CUDA where its kernel applies).
    row["fused"] = bool(torch.ops.sdpa_math.forward_stats_has_kernel(q, k, v, None, s.causal, scale, s.Hq != s.Hkv,
                                                                      True, True, 0))
    with torch.no_grad():
        fns = {name: (lambda f=f: f(q, k, v, s, scale)) for name, f in impls.items()}
        times, errors = interleaved_ms(fns, device, reps=reps)
        row["ms"] = {name: t for name, (t, _) in times.items()}
        row["samples"] = {name: samples for name, (_, samples) in times.items()}
        row["errors"] = errors
        # Accuracy against float64 on the same rounded inputs; extra memory on CUDA.
        ref = attention_stats_reference(q, k, v, s, scale)
        row["rel_err"] = {}
        for name in ("ours", "chunks", "native"):
            if name in errors:
                continue
            res = impls[name](q, k, v, s, scale)
            cs, ent = (res[1]["col_sum"], res[1]["row_entropy"]) if isinstance(res[1], dict) else res
            row["rel_err"][name] = {"col_sum": _rel(cs, ref[0]), "row_entropy": _rel(ent, ref[1])}
        row["peak_extra_bytes"] = {name: peak_extra_bytes(fn, device) for name, fn in fns.items() if name not in errors}
    base = row["ms"].get("native")
    row["speedup_vs_native"] = {name: base / t for name, t in row["ms"].items() if base}
    flash = row["ms"].get("flash")
    row["x_flash"] = {name: t / flash for name, t in row["ms"].items() if flash}
    row["kl_fwdbwd"] = run_kl(s, dtype, device, reps, q, k, v, scale)
    return row


def attention_stats_reference(q, k, v, s, scale):
    """col_sum and row_entropy in float64 from the float64 map of the same (rounded) inputs."""
    _, P = aten_math(q.double(), k.double(), v.double(), is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
    return P.sum(-2), -(P * torch.log(torch.where(P > 0, P, torch.ones_like(P)))).sum(-1)
