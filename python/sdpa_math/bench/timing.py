"""How the benchmark times: interleaved rounds of calls (interleaved_ms), a CUDA sample with the
host's issuing hidden behind a spin kernel (TIMING), peak extra device memory, the machine's
ceilings measured in the run, and each shape's roofline floor."""
from __future__ import annotations

import statistics
import time

import torch

from .shapes import Shape


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# How a CUDA sample is taken. "gpu" (the default): a spin kernel (torch.cuda._sleep) is queued first
# so the GPU is still busy while the host issues fn's kernels; the events then time the GPU work
# alone, as a program that keeps the GPU fed sees it, and the floor (a GPU floor) is comparable.
# "wall": the events time a call issued to an idle GPU, so the host's time to issue the call
# (Python, dispatcher, autograd, launches) is inside the sample; kept for comparison with runs
# that used it. The host's time to issue each call is recorded either way.
TIMING = "gpu"  # set by the command line's --timing
_cycles_per_ms = None


def _spin_cycles_per_ms():
    """Clock cycles of torch.cuda._sleep per millisecond on this GPU, measured once."""
    global _cycles_per_ms
    if _cycles_per_ms is None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 2_000_000
        torch.cuda._sleep(n)  # warm
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
        _cycles_per_ms = n / max(a.elapsed_time(b), 1e-3)
    return _cycles_per_ms


def _call_ms(fn, device, lead_ms=0.0):
    """(ms, host_ms) of one fn(): ms from CUDA events on the GPU (see TIMING) or perf_counter on
    the CPU; host_ms is the host's time to return from fn() (on CUDA: to issue its work)."""
    if device == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_ms > 0:
            torch.cuda._sleep(int(lead_ms * _spin_cycles_per_ms()))
        a.record()
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e3
        b.record()
        b.synchronize()
        return a.elapsed_time(b), host
    t0 = time.perf_counter()
    fn()
    t = (time.perf_counter() - t0) * 1e3
    return t, t


def interleaved_ms(fns, device, warmup=3, reps=10, budget_s=2.0, host=None):
    """Median times of several functions, measured in rounds (one call of each per round) so
    that every one sees the same machine: a slow spell on a shared 2-core machine then moves
    all of a row's numbers, not the ratios between them. Returns {name: (median, samples)} and
    {name: error} for those that raised during warm-up; `host`, if a dict, receives each
    function's median host time to issue one call (ms)."""
    live, errors, issue = {}, {}, {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                _sync(device)
                issue.setdefault(name, []).append(_call_ms(fn, device)[1])
            live[name] = fn
        except Exception as e:  # a failing alternative is recorded, not fatal
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if not live:
        return {}, errors
    _sync(device)
    # The spin must outlast the host's issuing of the call, or part of it shows in the sample.
    lead = {name: (max(1.0, 3 * issue[name][-1]) if device == "cuda" and TIMING == "gpu" else 0.0)
            for name in live}
    samples = {name: [] for name in live}
    hosts = {name: [] for name in live}
    start = time.perf_counter()
    for rounds in range(1, reps + 1):
        for name, fn in live.items():
            ms, h = _call_ms(fn, device, lead[name])
            samples[name].append(ms)
            hosts[name].append(h)
        if rounds >= 3 and time.perf_counter() - start > budget_s * len(live):
            break
    if host is not None:
        host.update({name: statistics.median(h) for name, h in hosts.items()})
    return {name: (statistics.median(t), t) for name, t in samples.items()}, errors


def median_ms(fn, device, warmup=3, reps=10, budget_s=2.0):
    """Median wall time of fn() in ms, and the samples."""
    return interleaved_ms({"fn": fn}, device, warmup, reps, budget_s)[0]["fn"]


def peak_extra_bytes(fn, device):
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return int(peak)


def ceilings(device):
    """Copy bandwidth (bytes read + written per second) and matrix-product rate, measured now."""
    if device == "cuda":
        n = 1 << 29  # 2^29 fp16 elements: 1 GiB read and 1 GiB written per copy
        src = torch.empty(n, dtype=torch.float16, device="cuda")
        dst = torch.empty_like(src)
        t, _ = median_ms(lambda: dst.copy_(src), device, reps=20)
        bw = 2 * src.numel() * 2 / (t * 1e-3)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        t, _ = median_ms(lambda: a @ b, device, reps=20)
        flops = 2 * 8192**3 / (t * 1e-3)
        del src, dst, a, b
        return {"copy_Bps": bw, "mm_flops": flops, "mm_dtype": "bfloat16"}
    n = 1 << 26
    src = torch.empty(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    t, _ = median_ms(lambda: dst.copy_(src), device, reps=10)
    bw = 2 * n * 4 / (t * 1e-3)
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    t, _ = median_ms(lambda: a @ b, device, reps=10)
    return {"copy_Bps": bw, "mm_flops": 2 * 1024**3 / (t * 1e-3), "mm_dtype": "float32"}


def floor_ms(s: Shape, dtype, ceil):
    """Roofline floor of a forward returning (O, P): the larger of the products' time at the
    measured matrix rate and the time to move Q, K, V, O and P at the measured copy bandwidth.
    Causal L = S halves the products. A mask adds its own bytes, read once (a (B, 1, L, S) float
    mask: P's size over the heads). Forward+backward: three times the forward (twice the
    products again, and P, dP read back)."""
    es = torch.finfo(dtype).bits // 8
    f = 0.5 if (s.causal and s.L == s.S) else 1.0
    flops = 4 * s.B * s.Hq * s.L * s.S * s.D * f
    mask_bytes = {"fmask": es * s.B * s.L * s.S, "kpad": s.B * s.S, "hfmask": s.B * s.L * s.S}.get(s.variant, 0)
    bytes_ = es * (s.B * s.Hq * s.L * s.D * 2 + s.B * s.Hkv * s.S * s.D * 2 + s.p_elems()) + mask_bytes
    fwd = max(flops / ceil["mm_flops"], bytes_ / ceil["copy_Bps"]) * 1e3
    return {"fwd_ms": fwd, "fwdbwd_ms": 3 * fwd, "fwd_flops": flops, "bytes": bytes_}


def output_bytes(s: Shape, dtype):
    """Bytes of a forward's outputs: P and O in the inputs' dtype, lse in fp32; and the memory
    target of issue 12 for a forward's extra device memory, 1.1 x (P + O + lse) + 64 MiB."""
    es = torch.finfo(dtype).bits // 8
    b = {"P": es * s.p_elems(), "O": es * s.B * s.Hq * s.L * s.D, "lse": 4 * s.B * s.Hq * s.L}
    b["target"] = int(1.1 * (b["P"] + b["O"] + b["lse"])) + 64 * 2**20
    return b
