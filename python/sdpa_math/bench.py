"""Side-by-side benchmark of attention that returns P, and the performance gate.

    python -m sdpa_math.bench run  [--device cpu|cuda] [--set NAME] [--dtypes ...] [--out DIR]
    python -m sdpa_math.bench gate RUN.json BASELINE.json [--threshold F] [--subset]
    python -m sdpa_math.bench stats [--device cpu|cuda] [--set NAME] [--dtypes ...] [--out DIR]

`run` times, in one process and on one device, forward (O, P) and forward+backward through both
outputs (random dO and dP) of:
  ours      sdpa_math.attention
  override  aten::_scaled_dot_product_attention_math under sdpa_math.enable() (checks that the
            override really took the call)
  native    aten::_scaled_dot_product_attention_math, default settings
  native16  the same with fp16/bf16 reduction allowed (CUDA, fp16/bf16 only)
  eager     attention as Hugging Face models write it (fp32 softmax)
  compiled  torch.compile of `eager`
  lse       O and log-sum-exp from PyTorch's fused kernel, then P = exp(scale QK^T + mask - lse)
  flash     PyTorch's fused kernel without P: the speed of light, not a competitor
On CUDA a sample is the GPU time of one call (`--timing gpu`, the default): a spin kernel queued
first keeps the GPU busy while the host issues the call, as in a program that keeps its GPU fed;
the host's time to issue each call is reported beside it. `--timing wall` times a call issued to
an idle GPU instead, host time included (the method until session 15).
It measures the machine's ceilings in the same run (a large copy, a large matrix product), gives
each shape's roofline floor and the fraction of it reached, the peak extra device memory and the
relative error of O and P against a float64 reference, and writes bench.json (every raw number,
the machine and software), bench.md (tables) and, for a sweep, speedup.png.

Sets (`--set`): the GPU anchors, the CPU set, CI's set, a sweep of lengths, and the input
variants real models pass (`variants`: a (B, 1, L, S) float mask, a (B, 1, 1, S) key-padding
bool mask, q/k/v as transposed views of (B, L, H, E); rows named `<base>_fmask`, `<base>_kpad`,
`<base>_blhe`), alone with their base row or appended to the anchors (`anchors+variants`) or the
CPU set (`cpu+variants`).

`stats` times the statistics-only forward (column sums and row entropy per head, no gradient) of
sdpa_math.stats.attention_stats against the same statistics from the math op's P, from compiled
eager attention (CUDA) and flash attention's forward without P, with each one's error against
float64; it writes stats.json and stats.md (issue 16).

`gate` compares a run with a committed baseline of the same device profile and prints
`FAIL n · WARN n` (and `NEW n` for rows the baseline lacks, which it does not judge): it judges
same-run ratios only (ours against native, ours against the floor), never absolute times across
runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import pathlib
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import sdpa_math

aten_math = torch.ops.aten._scaled_dot_product_attention_math

# ---------------------------------------------------------------------------------------------
# Shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    D: int
    causal: bool = False
    variant: str = ""  # "" (contiguous, no mask) or a key of VARIANTS

    def p_elems(self):
        return self.B * self.Hq * self.L * self.S

    def base_name(self):
        """The row this one varies: the same shape with contiguous inputs and no mask."""
        return self.name[: -len(self.variant) - 1] if self.variant else self.name

    def padded_keys(self):
        """Masked rows: how many keys at the end of each batch's key sequence are padding. Batch
        b pads b·S/(2B) of them (batch 0 none, the last almost half), so no row is fully masked
        and the batches differ, as in a padded batch of prompts of different lengths."""
        return [b * self.S // (2 * self.B) for b in range(self.B)]


# The seven anchor shapes of docs/design.md (GPU).
ANCHORS = [
    Shape("prefill1k_d64", 4, 16, 16, 1024, 1024, 64),
    Shape("prefill1k_d128", 4, 16, 16, 1024, 1024, 128),
    Shape("prefill2k_d128_causal", 2, 16, 16, 2048, 2048, 128, True),
    Shape("gqa1k_d128", 4, 32, 8, 1024, 1024, 128),
    Shape("decode_s2k_d128", 32, 32, 32, 1, 2048, 128),
    Shape("tail100_d64", 8, 16, 16, 100, 1100, 64),
    Shape("long4k_d128_causal", 1, 32, 32, 4096, 4096, 128, True),
]
# Sized for a 2-core CPU: each forward takes milliseconds, not seconds.
CPU_SET = [
    Shape("cpu_256_d64", 1, 8, 8, 256, 256, 64),
    Shape("cpu_512_d64", 2, 8, 8, 512, 512, 64),
    Shape("cpu_512_d128_causal", 1, 8, 8, 512, 512, 128, True),
    Shape("cpu_gqa512_d64", 1, 8, 2, 512, 512, 64),
    Shape("cpu_decode_s2k_d64", 4, 8, 8, 1, 2048, 64),
    Shape("cpu_tail100_d64", 2, 8, 8, 100, 300, 64),
]
# CI's gate: small and quick, still well past timer resolution.
CI_SET = [
    Shape("ci_256_d64", 1, 4, 4, 256, 256, 64),
    Shape("ci_384_d64_causal", 1, 4, 4, 384, 384, 64, True),
    Shape("ci_gqa256_d64", 1, 8, 2, 256, 256, 64),
]


# The inputs real models pass (Hugging Face attention modules), as variants of one shape. Each
# row gets the base shape's name with the variant's as a suffix; every implementation gets the
# same tensors.
VARIANTS = {
    "fmask": "float additive mask (B, 1, L, S) in the inputs' dtype: 0, or finfo(dtype).min on padded keys",
    "kpad": "key-padding bool mask (B, 1, 1, S), True = attend",
    "hfmask": "Hugging Face's causal-and-padding bool mask (B, 1, L, S): row i attends to keys <= i that are "
              "not padding",
    "blhe": "q, k, v as .transpose(1, 2) views of contiguous (B, L, H, E) tensors",
}
# The variants with a mask; each hides the last `padded_keys()[b]` keys of batch b.
MASKED_VARIANTS = ("fmask", "kpad", "hfmask")


def variants_of(base: Shape):
    return [dataclasses.replace(base, name=f"{base.name}_{v}", variant=v) for v in VARIANTS]


def _shape(shapes, name):
    return next(s for s in shapes if s.name == name)


def variant_base(device):
    """The shape the variant rows vary: prefill1k_d128 on the GPU, cpu_512_d64 on the CPU."""
    return _shape(ANCHORS, "prefill1k_d128") if device == "cuda" else _shape(CPU_SET, "cpu_512_d64")


def variants(device):
    """The variant rows with their base row, the time they are compared with."""
    return [variant_base(device)] + variants_of(variant_base(device))


def sweep(device):
    lengths = [256, 512, 1024, 2048, 4096] if device == "cuda" else [64, 128, 256, 512, 1024]
    heads = 16 if device == "cuda" else 4
    return [Shape(f"sweep_{n}_d64", 1 if device == "cpu" else 4, heads, heads, n, n, 64) for n in lengths]


SETS = {"anchors": lambda d: ANCHORS, "cpu": lambda d: CPU_SET, "ci": lambda d: CI_SET, "sweep": sweep,
        "anchors+sweep": lambda d: ANCHORS + sweep(d), "cpu+sweep": lambda d: CPU_SET + sweep(d),
        "variants": variants,
        "anchors+variants": lambda d: ANCHORS + variants_of(variant_base("cuda")),
        "cpu+variants": lambda d: CPU_SET + variants_of(variant_base("cpu"))}

# ---------------------------------------------------------------------------------------------
# Implementations: each maps (q, k, v, shape, scale, mask) to (O, P) or O alone (flash).


def _repeat_kv(x, n):
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _causal_hidden(q, k):
    """True where top-left causal attention hides key j from query i (j > i)."""
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)


def additive_mask(mask, dtype):
    """A bool mask as the float mask F.scaled_dot_product_attention hands to its math and
    efficient backends (0 where True, -inf where False); a float mask or None unchanged. The aten
    math op called directly would add a bool mask's 0/1 to the scores instead."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _apply_mask(scores, mask):
    if mask is None:
        return scores
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def eager_attention(q, k, v, causal, scale, mask=None):
    """Attention as Hugging Face's eager path writes it: scores plus the mask, fp32 softmax,
    cast back, then P V."""
    g = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, g), _repeat_kv(v, g)
    scores = _apply_mask(torch.matmul(q, k.transpose(-1, -2)) * scale, mask)
    if causal:
        scores = scores.masked_fill(_causal_hidden(q, k), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v), probs


def _lse_then_probs(q, k, v, causal, scale, mask=None):
    g = q.shape[1] // k.shape[1]
    bias = additive_mask(mask, q.dtype)
    if q.is_cuda:
        # As F.scaled_dot_product_attention passes a mask to the efficient kernel: expanded to
        # (B, H, L, S) (a view).
        eb = None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, _repeat_kv(k, g), _repeat_kv(v, g), eb,
                                                                          True, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, _repeat_kv(k, g), _repeat_kv(v, g),
                                                                              0.0, causal, attn_mask=bias, scale=scale)
    scores = torch.matmul(q, _repeat_kv(k, g).transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        scores = scores.masked_fill(_causal_hidden(q, k), float("-inf"))
    # The fused kernels may pad lse's rows (to a multiple of 32 on CUDA).
    probs = torch.exp(scores - lse[..., : q.shape[-2]].float().unsqueeze(-1)).to(q.dtype)
    return out, probs


def _fused_sdpa(q, k, v, causal, scale, gqa, mask):
    """PyTorch's fused SDPA without P. With a mask FlashAttention does not apply, so on CUDA this
    is the memory-efficient kernel; it is held to the fused backends (never the math op) so that
    the column always means a fused kernel."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)


def compile_per_shape(fn):
    """torch.compile(fn) specialised to each shape and dtype. One graph per shape, dtype and grad
    mode: the recompile limit is raised so that no row silently falls back to eager (the default
    of 8 did that to the statistics rows after eight shapes)."""
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    return torch.compile(fn, dynamic=False)


class Impls:
    def __init__(self, device):
        self.device = device
        self._compiled = compile_per_shape(eager_attention)

    def names(self, dtype):
        names = ["ours", "override", "native"]
        if self.device == "cuda" and dtype in (torch.float16, torch.bfloat16):
            names.append("native16")
        return names + ["eager", "compiled", "lse", "flash"]

    def call(self, name, q, k, v, s: Shape, scale, mask=None):
        """Every implementation gets the same q, k, v (any layout) and mask. The aten op's
        callers (override, native, native16) get a bool mask as F.scaled_dot_product_attention
        would pass it on (`additive_mask`, converted inside the timed call); the others take it
        as it is."""
        gqa = s.Hq != s.Hkv
        if name == "ours":
            return sdpa_math.attention(q, k, v, attn_mask=mask, is_causal=s.causal, scale=scale, enable_gqa=gqa)
        if name == "override":
            with sdpa_math.override():
                return aten_math(q, k, v, additive_mask(mask, q.dtype), 0.0, s.causal, scale=scale, enable_gqa=gqa)
        if name == "native":
            return aten_math(q, k, v, additive_mask(mask, q.dtype), 0.0, s.causal, scale=scale, enable_gqa=gqa)
        if name == "native16":
            prev = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
            try:
                return aten_math(q, k, v, additive_mask(mask, q.dtype), 0.0, s.causal, scale=scale, enable_gqa=gqa)
            finally:
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(prev)
        if name == "eager":
            return eager_attention(q, k, v, s.causal, scale, mask)
        if name == "compiled":
            return self._compiled(q, k, v, s.causal, scale, mask)
        if name == "lse":
            return _lse_then_probs(q, k, v, s.causal, scale, mask)
        if name == "flash":
            return _fused_sdpa(q, k, v, s.causal, scale, gqa, mask)
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Timing, memory, ceilings


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# How a CUDA sample is taken. "gpu" (the default): a spin kernel (torch.cuda._sleep) is queued first
# so the GPU is still busy while the host issues fn's kernels; the events then time the GPU work
# alone, as a program that keeps the GPU fed sees it, and the floor (a GPU floor) is comparable.
# "wall": the events time a call issued to an idle GPU, so the host's time to issue the call
# (Python, dispatcher, autograd, launches) is inside the sample; it was the method until session
# 15 and is kept for comparison. The host's time to issue each call is recorded either way.
TIMING = "gpu"
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


# ---------------------------------------------------------------------------------------------
# One row


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make_inputs(s: Shape, dtype, device, seed=0):
    """q, k, v (B, H, n, E) and the mask (None unless the variant has one) of a row. "blhe":
    q, k, v drawn as contiguous (B, n, H, E) and viewed as (B, H, n, E), the layout Hugging Face
    attention modules pass. "fmask": a materialised (B, 1, L, S) float mask in the inputs' dtype,
    0 or finfo(dtype).min (Hugging Face's padding mask for eager and SDPA). "kpad": a (B, 1, 1, S)
    bool mask, True = attend. "hfmask": a (B, 1, L, S) bool mask, the causal rule (top left: row i
    sees keys <= i) and the padding in one, as Hugging Face builds it for SDPA when a batch is
    padded. The masks hide the last `s.padded_keys()[b]` keys of batch b."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if s.variant == "blhe":
        mk = lambda h, n: torch.randn(s.B, n, h, s.D, generator=gen, device=device,  # noqa: E731
                                      dtype=dtype).transpose(1, 2)
    else:
        mk = lambda h, n: torch.randn(s.B, h, n, s.D, generator=gen, device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(s.Hq, s.L), mk(s.Hkv, s.S), mk(s.Hkv, s.S)
    mask = None
    if s.variant in MASKED_VARIANTS:
        valid = s.S - torch.tensor(s.padded_keys(), device=device)
        attend = torch.arange(s.S, device=device) < valid.unsqueeze(-1)  # (B, S)
        if s.variant == "kpad":
            mask = attend[:, None, None, :].contiguous()
        elif s.variant == "hfmask":
            causal = torch.arange(s.S, device=device) <= torch.arange(s.L, device=device)[:, None]  # (L, S)
            mask = (attend[:, None, :] & causal)[:, None].contiguous()
        else:
            mask = torch.zeros(s.B, 1, s.L, s.S, dtype=dtype, device=device)
            mask.masked_fill_(~attend[:, None, None, :], torch.finfo(dtype).min)
    return q, k, v, mask


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


# ---------------------------------------------------------------------------------------------
# Provenance: which code a run measured


def code_hash():
    """Hash of the sources that decide what is measured (the C++/CUDA core, the binding and the
    Python package), taken from the source tree this module was imported from when it is one,
    else from the installed package files."""
    base = pathlib.Path(__file__).resolve().parents[2]
    files = []
    if (base / "src").is_dir() and (base / "python" / "sdpa_math").is_dir():
        for sub in ("src", "include", "python/sdpa_math"):
            files += [p for p in (base / sub).rglob("*") if p.is_file() and p.suffix in
                      (".h", ".cuh", ".cpp", ".cu", ".py", ".txt")]
    else:  # an installed package: its Python files and the compiled extension
        base = pathlib.Path(__file__).resolve().parent
        files = [p for p in base.rglob("*.py")] + [p for p in base.glob("_C*.so")]
    h = hashlib.sha256()
    for p in sorted(files):  # paths relative to the tree: the same code hashes alike in any checkout
        h.update(str(p.relative_to(base)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


# x86 extensions that move the CPU gate's ratios: our kernels and torch's products use them
# differently (session 22's machine, with AVX-512 and AMX, ran torch's fp32 products twice as
# fast as the one before it, and every CPU ratio fell by about half; bench/NOTES.md).
CPU_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_kind(cpuinfo: str | None = None):
    """The CPU as the gate compares it: {"model": "family-model name", "isa": the CPU_ISA_FLAGS it
    has}, from /proc/cpuinfo's first processor (or the text given); None where there is none
    (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block ends
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    if not fields:
        return None
    flags = set(fields.get("flags", "").split())
    model = f"{fields.get('cpu family', '?')}-{fields.get('model', '?')} {fields.get('model name', '')}".strip()
    return {"model": model, "isa": [f for f in CPU_ISA_FLAGS if f in flags]}


def machine_text(info) -> str:
    """The machine of a run's info for a report: the GPU's name, else the CPU's kind (model and ISA
    extensions) where recorded, else the architecture."""
    if info.get("gpu"):
        return info["gpu"]
    kind = info.get("cpu_kind")
    if kind:
        return f"{kind['model']} ({', '.join(kind['isa']) or 'no AVX2'})"
    return info.get("cpu", "?")


def machine_info(device):
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
            "cpu": platform.processor() or platform.machine(), "cpu_kind": cpu_kind(),
            "threads": torch.get_num_threads(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "code_hash": code_hash(), "sdpa_math": getattr(sdpa_math, "__version__", "?")}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


# ---------------------------------------------------------------------------------------------
# Reports

COLUMNS = ["ours", "native", "native16", "eager", "compiled", "lse", "flash"]


def markdown(run):
    lines = [f"# sdpa_math benchmark · {run['info']['device']} · {machine_text(run['info'])} · "
             f"torch {run['info']['torch']} · {run['info']['time']}", "",
             f"Ceilings measured in this run: copy {run['ceilings']['copy_Bps'] / 1e12:.3f} TB/s, "
             f"{run['ceilings']['mm_dtype']} matrix product {run['ceilings']['mm_flops'] / 1e12:.1f} TFLOP/s.", ""]
    timing = run["info"].get("timing", "wall")
    if run["info"]["device"] == "cuda":
        lines += [("Timing: GPU time of one call, its issuing hidden behind a spin kernel queued first (`--timing gpu`); "
                   "the host's time to issue each call is in its own table below." if timing == "gpu" else
                   "Timing: one call issued to an idle GPU, the host's time to issue it included (`--timing wall`)."), ""]
    for phase, title in (("fwd_ms", "Forward (O, P)"), ("fwdbwd_ms", "Forward + backward through O and P")):
        lines += [f"## {title}: median ms (speedup of ours over each)", "",
                  "| shape | dtype | floor | " + " | ".join(COLUMNS) + " | ours/floor |",
                  "|---|---|---|" + "---|" * len(COLUMNS) + "---|"]
        for row in run["rows"]:
            ours = row["impls"].get("ours", {})
            if phase not in ours:
                continue
            cells = []
            for n in COLUMNS:
                r = row["impls"].get(n)
                if r is None or phase not in r:
                    cells.append("–" if r is None or "error" not in r else "err")
                elif n == "ours":
                    cells.append(f"**{r[phase]:.3f}**")
                else:
                    cells.append(f"{r[phase]:.3f} ({r[phase] / ours[phase]:.2f}x)")
            lines.append(f"| {row['shape']} | {row['dtype']} | {row['floor'][phase]:.3f} | " + " | ".join(cells)
                         + f" | {ours[phase] / row['floor'][phase]:.2f} |")
        lines.append("")
    lines += variants_markdown(run)
    lines += host_markdown(run)
    lines += ["## Error against float64 (relative Frobenius) and peak extra memory of a forward", "",
              "Extra memory: the peak of torch.cuda.max_memory_allocated during one forward above what was "
              "allocated before it (the inputs), outputs included; target 1.1 x (P + O + lse) + 64 MiB.", "",
              "| shape | dtype | impl | err O | err P | extra MB | extra / (P+O+lse) | within target |",
              "|---|---|---|---|---|---|---|---|"]
    for row in run["rows"]:
        ob = row.get("output_bytes") or output_bytes(Shape(row["shape"], row["B"], row["Hq"], row["Hkv"], row["L"],
                                                           row["S"], row["D"]), getattr(torch, row["dtype"]))
        polse = ob["P"] + ob["O"] + ob["lse"]
        for n, r in row["impls"].items():
            if "rel_err_o" not in r:
                continue
            ep = "–" if r["rel_err_p"] is None else f"{r['rel_err_p']:.2e}"
            mem = r.get("peak_extra_bytes")
            cells = ["–"] * 3 if mem is None else [f"{mem / 2**20:.1f}", f"{mem / polse:.2f}",
                                                   "yes" if mem <= ob["target"] else "**no**"]
            lines.append(f"| {row['shape']} | {row['dtype']} | {n} | {r['rel_err_o']:.2e} | {ep} | "
                         + " | ".join(cells) + " |")
    errors = [(row["shape"], row["dtype"], n, r["error"]) for row in run["rows"] for n, r in row["impls"].items()
              if "error" in r]
    if errors:
        lines += ["", "## Alternatives that failed to run", ""] + [f"- {a} {b} {n}: {e}" for a, b, n, e in errors]
    return "\n".join(lines) + "\n"


# Issue 12's targets for the variant rows, ours against ours on the base row: masks within 1.25x
# of the unmasked time, transposed views within 1.1x of contiguous.
def host_markdown(run):
    """The host's time to issue one call (Python, dispatcher, autograd, launches): what a GPU
    time leaves out, and what a program pays when it waits on each call."""
    if run["info"]["device"] != "cuda":
        return []
    names = [n for n in ("ours", "flash", "compiled", "eager", "native") if n in COLUMNS]
    lines = ["## Host time to issue one call (median ms)", "",
             "| shape | dtype | " + " | ".join(f"{n} fwd | {n} f+b" for n in names) + " |",
             "|---|---|" + "---|---|" * len(names)]
    for row in run["rows"]:
        cells = []
        for n in names:
            r = row["impls"].get(n, {})
            cells += [f"{r[k]:.3f}" if k in r else "–" for k in ("fwd_host_ms", "fwdbwd_host_ms")]
        lines.append(f"| {row['shape']} | {row['dtype']} | " + " | ".join(cells) + " |")
    lines += ["", "## Back to back: max(GPU time, host time) per call (median ms)", "",
              "What a loop issuing one call after another sustains when it never waits on the GPU: whichever "
              "of the GPU and the host is slower sets the pace.", "",
              "| shape | dtype | " + " | ".join(f"{n} fwd | {n} f+b" for n in names) + " |",
              "|---|---|" + "---|---|" * len(names)]
    for row in run["rows"]:
        ours = row["impls"].get("ours", {})
        cells = []
        for n in names:
            r = row["impls"].get(n, {})
            for phase in ("fwd", "fwdbwd"):
                if f"{phase}_ms" not in r or f"{phase}_host_ms" not in r:
                    cells.append("–")
                    continue
                t = max(r[f"{phase}_ms"], r[f"{phase}_host_ms"])
                mine = max(ours.get(f"{phase}_ms", 0.0), ours.get(f"{phase}_host_ms", 0.0))
                cells.append(f"{t:.3f}" if n == "ours" or not mine else f"{t:.3f} ({t / mine:.2f}x)")
        lines.append(f"| {row['shape']} | {row['dtype']} | " + " | ".join(cells) + " |")
    return lines + [""]


# Issue 12's targets against the unmasked, non-causal base row. hfmask hides about half the keys
# (causal): at 1.25 it would still be doing the hidden half's work.
VARIANT_TARGET = {"fmask": 1.25, "kpad": 1.25, "hfmask": 1.25, "blhe": 1.1}


def variants_markdown(run):
    """Ours on each variant row against ours on its base row of the same run and dtype."""
    by_key = {(r["shape"], r["dtype"]): r for r in run["rows"]}
    out = []
    for row in run["rows"]:
        base = by_key.get((row.get("variant_of"), row["dtype"])) if row.get("variant_of") else None
        if base is None:
            continue
        cells = []
        for phase in ("fwd_ms", "fwdbwd_ms"):
            a, b = row["impls"].get("ours", {}).get(phase), base["impls"].get("ours", {}).get(phase)
            cells += ["–"] * 3 if a is None or b is None else [f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}"]
        out.append(f"| {row['shape']} | {row['dtype']} | {row['variant_of']} | " + " | ".join(cells)
                   + f" | {VARIANT_TARGET.get(row.get('variant'), float('nan')):.2f} |")
    if not out:
        return []
    legend = [f"- `_{v}`: {d}" for v, d in VARIANTS.items()]
    return ["## Input variants: ours against ours on the base row (same run, same dtype)", ""] + legend + [
            "", "| row | dtype | base | fwd ms | base fwd ms | fwd / base | f+b ms | base f+b ms | f+b / base "
            "| fwd target |", "|---|---|---|---|---|---|---|---|---|---|"] + out + [""]


def plot(run, path):
    rows = [r for r in run["rows"] if r["shape"].startswith("sweep_")]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("fwd_ms", "fwdbwd_ms")):
        for dtype in sorted({r["dtype"] for r in rows}):
            sel = [r for r in rows if r["dtype"] == dtype and phase in r["speedup"]]
            for n in ("native", "eager", "compiled", "lse"):
                pts = [(r["L"], r["speedup"][phase][n]) for r in sel if n in r["speedup"][phase]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"vs {n} ({dtype})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L = S")
        ax.set_ylabel("speedup of sdpa_math")
        ax.set_title("forward (O, P)" if phase == "fwd_ms" else "forward + backward")
        ax.legend(fontsize=7)
    fig.suptitle(f"sdpa_math on {machine_text(run['info'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


# ---------------------------------------------------------------------------------------------
# The gate


def new_rows(run, baseline):
    """(shape, dtype) of the run's rows that the baseline does not have: reported as new, with no
    ratio to judge (an older baseline predates them)."""
    have = {(b["shape"], b["dtype"]) for b in baseline["rows"]}
    return [(r["shape"], r["dtype"]) for r in run["rows"] if (r["shape"], r["dtype"]) not in have]


def is_stats_row(row):
    """A row of `bench stats` (statistics of P), not of `bench run`."""
    return "x_flash" in row


def judged_ratios(row):
    """The same-run ratios the gate judges in a row, by name; higher is better. `bench run` rows:
    ours against the math op and against the floor, forward and forward + backward. `bench stats`
    rows: the statistics forward against the math op's P and its reductions, ours and rows64
    against flash attention's forward (flash time / ours), and kl_to's forward + backward against
    flash attention's."""
    if is_stats_row(row):
        out = {}
        if row.get("speedup_vs_native", {}).get("ours") is not None:
            out["stats vs native"] = row["speedup_vs_native"]["ours"]
        for name in ("ours", "rows64"):
            if row.get("x_flash", {}).get(name):
                out[f"stats {name} vs flash"] = 1.0 / row["x_flash"][name]
        if row.get("kl_fwdbwd", {}).get("x_flash"):
            out["kl_to fwd+bwd vs flash"] = 1.0 / row["kl_fwdbwd"]["x_flash"]
        return out
    return {f"{phase} vs {against}": v for phase in ("fwd_ms", "fwdbwd_ms") for against in ("native", "floor")
            if (v := row.get("speedup", {}).get(phase, {}).get(against)) is not None}


def _row_problems(row):
    """Reasons a row fails without a baseline: an error in ours, or (bench run) an override that
    did not take the aten call."""
    if is_stats_row(row):
        return [f"ours failed: {row['errors']['ours']}"] if "ours" in row.get("errors", {}) else []
    ours, ov = row["impls"].get("ours", {}), row["impls"].get("override", {})
    if "error" in ours:
        return [f"ours failed: {ours['error']}"]
    if ov and "error" in ov:
        return [f"the override failed: {ov['error']}"]
    if ov and not ov.get("override_took_call", False):
        return ["the override did not take the aten call (fell back to native)"]
    return []


def gate(run, baseline, threshold, current_hash=None, subset=False):
    """Returns (fails, warns), lists of reasons. A row of the baseline missing from the run, a
    run that measured other code than the tree's, an override that did not take its call, an
    error in ours, or a statistics row that the fused kernel ran in the baseline and not in the
    run, is a FAIL; a same-run ratio (`judged_ratios`) below the baseline's by more than
    `threshold` is a FAIL, by more than half of it a WARN. Rows of the run that the baseline lacks
    (`new_rows`) have no ratios to judge; an error in ours or an override that did not take its
    call there still FAILs, as neither needs a baseline. With `subset`, a baseline row missing
    from the run is not judged (a run of some of the baseline's sets). A CPU run on another kind of
    CPU than the baseline's (`cpu_kind`: model or ISA extensions differ, where both runs record
    it) is a WARN: its ratios can shift with the machine alone. The same rules hold for `bench run`
    and `bench stats` runs (each against a baseline of its own kind)."""
    fails, warns = [], []
    kinds = run["info"].get("cpu_kind"), baseline["info"].get("cpu_kind")
    if run["info"].get("device") == "cpu" and None not in kinds and kinds[0] != kinds[1]:
        def text(k):
            return f"{k.get('model')}, {' '.join(k.get('isa') or []) or 'none of ' + ' '.join(CPU_ISA_FLAGS)}"
        warns.append(f"the run's CPU ({text(kinds[0])}) is not the baseline's ({text(kinds[1])}): its ratios can "
                     "shift with the machine alone; a baseline made on this kind of CPU judges it")
    by_base = {(b["shape"], b["dtype"]) for b in baseline["rows"]}
    for r in run["rows"]:
        key = (r["shape"], r["dtype"])
        if key in by_base:
            continue
        fails += [f"{key} (new): {why}" for why in _row_problems(r)]
    if run["info"].get("device") != baseline["info"].get("device"):
        fails.append(f"device profile {run['info'].get('device')} is not the baseline's {baseline['info'].get('device')}")
    if current_hash is not None and run["info"].get("code_hash") != current_hash:
        fails.append(f"the run measured code {run['info'].get('code_hash')}, the tree is {current_hash}: rerun")
    by_key = {(r["shape"], r["dtype"]): r for r in run["rows"]}
    for b in baseline["rows"]:
        key = (b["shape"], b["dtype"])
        r = by_key.get(key)
        if r is None:
            if not subset:
                fails.append(f"{key}: missing from the run")
            continue
        problems = _row_problems(r)
        fails += [f"{key}: {why}" for why in problems]
        if problems and problems[0].startswith("ours failed"):
            continue
        if is_stats_row(b) and b.get("fused") and not r.get("fused"):
            fails.append(f"{key}: the fused statistics kernel no longer takes this row")
        got_ratios = judged_ratios(r)
        for name, base in judged_ratios(b).items():
            got = got_ratios.get(name)
            if got is None:
                fails.append(f"{key} {name}: not measured")
            elif got < base * (1 - threshold):
                fails.append(f"{key} {name}: {got:.2f}x, baseline {base:.2f}x")
            elif got < base * (1 - threshold / 2):
                warns.append(f"{key} {name}: {got:.2f}x, baseline {base:.2f}x")
    return fails, warns


# ---------------------------------------------------------------------------------------------
# Command line


# ---------------------------------------------------------------------------------------------
# Statistics of P (issue 16): column sums and row entropy per head, forward only, no gradient.

STATS_COLUMNS = ["ours", "rows64", "chunks", "native", "compiled", "flash"]


def _reduce_stats(P):
    """col_sum (Σ_i P) and row_entropy (−Σ P log P) of a map, in fp32, as a user writes them."""
    pf = P.float()
    return pf.sum(-2), -(pf * torch.log(torch.where(pf > 0, pf, torch.ones_like(pf)))).sum(-1)


def stats_impls(device):
    """name -> fn(q, k, v, s, scale): the statistics-only forward by each way a user has.
      ours     sdpa_math.stats.attention_stats (the fused operator: the CPU kernel, or on CUDA the
               Hopper kernel where it takes the inputs, else chunks)
      rows64   the same asked for P's last 64 rows only (SnapKV's window), no column sums or entropy
      chunks   the same with method="chunks" (chunks of P, each reduced and dropped)
      native   the math op's P, then the reductions
      compiled torch.compile of eager attention's P and the reductions (CUDA only: on the CPU its
               compile takes minutes per shape)
      flash    PyTorch's fused kernel without P or statistics: the speed of light"""
    from .stats import attention_stats

    def ours(q, k, v, s, scale, method="auto"):
        return attention_stats(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv,
                               col_sum="per_head", row_entropy=True, method=method)

    def native(q, k, v, s, scale):
        _, P = aten_math(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
        return _reduce_stats(P)

    def eager_stats(q, k, v, causal, scale, n_rep):
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        scores = (q @ k.transpose(-2, -1)) * scale
        if causal:
            scores = scores.masked_fill(_causal_hidden(q, k), float("-inf"))
        P = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return P @ v, _reduce_stats(P)

    def rows64(q, k, v, s, scale):
        return attention_stats(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv,
                               rows=slice(-64, None))

    impls = {"ours": ours, "rows64": rows64,
             "chunks": lambda q, k, v, s, scale: ours(q, k, v, s, scale, method="chunks"),
             "native": native,
             "flash": lambda q, k, v, s, scale: F.scaled_dot_product_attention(
                 q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)}
    if device == "cuda":
        compiled = compile_per_shape(eager_stats)
        impls["compiled"] = lambda q, k, v, s, scale: compiled(q, k, v, s.causal, scale, s.Hq // s.Hkv)
    return impls


KL_COLUMNS = ["ours", "native", "flash"]


def kl_impls():
    """name -> fn(q, k, v, ref, s, scale): forward + backward of a distillation term, KL(ref ‖ P)
    per row summed, with its gradient to q and k (issue 16's `kl_to` target):
      ours     sdpa_math.stats.attention_stats(kl_to=ref) (on Hopper the fused kernels, P never
               formed; elsewhere chunks of P, each recomputed in the backward)
      native   the math op's P, the KL written as a user writes it, autograd through both
      flash    PyTorch's fused kernel forward + backward through O (no P, no KL): the speed of light"""
    from .stats import attention_stats

    def ours(q, k, v, ref, s, scale):
        _, st = attention_stats(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv, kl_to=ref)
        return torch.autograd.grad(st["kl_to"].sum(), (q, k))

    def native(q, k, v, ref, s, scale):
        _, P = aten_math(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
        r, pf = ref.float(), P.float()
        kl = (torch.xlogy(r, r) - r * torch.log(torch.where(r > 0, pf, torch.ones_like(pf)))).sum(-1)
        return torch.autograd.grad(kl.sum(), (q, k))

    def flash(q, k, v, ref, s, scale):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    return {"ours": ours, "native": native, "flash": flash}


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


def stats_markdown(run):
    lines = ["# Statistics of P: col_sum + row_entropy, forward, no gradient", "",
             f"Machine: {machine_text(run['info'])}, {run['info'].get('threads')} CPU threads; "
             f"torch {run['info'].get('torch')}; timing: {run['info'].get('timing')}; code {run['info'].get('code_hash')}.",
             "",
             "ours: `attention_stats`, the fused operator where it applies (fused = yes: the CPU kernel, or the "
             "Hopper statistics kernel), else chunks of P; rows64: the same asked for P's last 64 rows only; "
             "chunks: the same by chunks of P; native: the math op's P, then the reductions; compiled: torch.compile "
             "of eager attention and the reductions; flash: PyTorch's fused kernel, no P and no statistics.", "",
             "| shape | dtype | fused | " + " | ".join(f"{c} ms" for c in STATS_COLUMNS) +
             " | ours x native | ours / flash | rows64 / flash | err ours | err chunks | err native |",
             "|" + "---|" * (3 + len(STATS_COLUMNS) + 3 + 3)]
    for r in run["rows"]:
        ms = r["ms"]
        cells = [f"{ms[c]:.3f}" if c in ms else "—" for c in STATS_COLUMNS]
        err = lambda n: (f"{max(r['rel_err'][n].values()):.1e}" if n in r["rel_err"] else "—")  # noqa: E731
        fused = {True: "yes", False: "no"}.get(r.get("fused"), "?")
        lines.append(f"| {r['shape']} | {r['dtype']} | {fused} | " + " | ".join(cells) +
                     f" | {r['speedup_vs_native'].get('ours', float('nan')):.2f} | {r['x_flash'].get('ours', float('nan')):.2f}"
                     f" | {r['x_flash'].get('rows64', float('nan')):.2f}"
                     f" | {err('ours')} | {err('chunks')} | {err('native')} |")
    lines += ["", "err: the larger relative (Frobenius) error of col_sum and row_entropy against float64."]
    kl_rows = [r for r in run["rows"] if "kl_fwdbwd" in r]
    if kl_rows:
        lines += ["", "## Distillation: KL(ref ‖ P) per row, forward + backward to q and k (median ms)", "",
                  "ours: `attention_stats(kl_to=ref)`; native: the math op's P and the KL by hand; flash: PyTorch's "
                  "fused kernel forward + backward through O alone (no P, no KL).", "",
                  "| shape | dtype | " + " | ".join(f"{c} ms" for c in KL_COLUMNS) + " | ours / flash | ours x native |",
                  "|" + "---|" * (2 + len(KL_COLUMNS) + 2)]
        for r in kl_rows:
            kl = r["kl_fwdbwd"]
            ms = kl["ms"]
            cells = [f"{ms[c]:.3f}" if c in ms else "—" for c in KL_COLUMNS]
            ratio = f"{kl['x_flash']:.2f}" if "x_flash" in kl else "—"
            vs_native = f"{ms['native'] / ms['ours']:.2f}" if ms.get("native") and ms.get("ours") else "—"
            lines.append(f"| {r['shape']} | {r['dtype']} | " + " | ".join(cells) + f" | {ratio} | {vs_native} |")
    return "\n".join(lines) + "\n"


def _setup(a, default_sets):
    """What `run` and `stats` share: the device, the set's shapes (default_sets: (cuda, cpu)),
    the dtypes, the output folder (made), and the timing method."""
    global TIMING
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SETS[a.set or default_sets[device != "cuda"]](device)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    TIMING = a.timing
    return device, shapes, [getattr(torch, d) for d in a.dtypes], out


def _cmd_stats(a):
    device, shapes, dtypes, out = _setup(a, ("anchors", "cpu"))
    masked = [s.name for s in shapes if s.variant in MASKED_VARIANTS]
    if masked:  # the statistics rows pass no mask (yet): a masked row would be mislabelled
        raise SystemExit(f"bench stats: rows with a mask are not supported here: {', '.join(masked)}")
    impls = stats_impls(device)
    run = {"info": {**machine_info(device), "device": device, "timing": TIMING if device == "cuda" else "wall"},
           "rows": []}
    for s in shapes:
        for dtype in dtypes:
            row = run_stats_row(impls, s, dtype, device, a.reps)
            run["rows"].append(row)
            print(f"{s.name:24s} {row['dtype']:9s} ours {row['ms'].get('ours', float('nan')):8.3f} ms  "
                  f"x native {row['speedup_vs_native'].get('ours', float('nan')):5.2f}", flush=True)
            (out / "stats.json").write_text(json.dumps(run, indent=1))
    (out / "stats.md").write_text(stats_markdown(run))
    print(f"wrote {out / 'stats.json'}, {out / 'stats.md'}")


def _cmd_run(a):
    device, shapes, dtypes, out = _setup(a, ("anchors+sweep", "cpu+sweep"))
    impls = Impls(device)
    ceil = ceilings(device)
    run = {"info": {**machine_info(device), "timing": TIMING if device == "cuda" else "wall"},
           "ceilings": ceil, "rows": []}
    for s in shapes:
        for dtype in dtypes:
            t0 = time.perf_counter()
            row = run_row(impls, s, dtype, device, ceil, a.reps, with_backward=not a.no_backward)
            run["rows"].append(row)
            sp = row["speedup"].get("fwd_ms", {})
            print(f"{s.name:24s} {row['dtype']:9s} fwd x native {sp.get('native', float('nan')):6.2f}  "
                  f"x floor {sp.get('floor', float('nan')):5.2f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
            (out / "bench.json").write_text(json.dumps(run, indent=1))
    (out / "bench.md").write_text(markdown(run))
    png = plot(run, out / "speedup.png")
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {png}" if png else ""))


def _cmd_gate(a):
    run = json.loads(pathlib.Path(a.run).read_text())
    baseline = json.loads(pathlib.Path(a.baseline).read_text())
    fails, warns = gate(run, baseline, a.threshold, None if a.no_hash_check else code_hash(), subset=a.subset)
    new = new_rows(run, baseline)
    for f in fails:
        print("FAIL", f)
    for w in warns:
        print("WARN", w)
    for key in new:
        print("NEW ", f"{key}: new, no baseline (ratios not judged)")
    print(f"FAIL {len(fails)} · WARN {len(warns)}" + (f" · NEW {len(new)}" if new else ""))
    return 1 if fails else 0


# The input dtypes the benchmark times (--dtypes): argparse names a wrong one before anything runs.
BENCH_DTYPES = ("float16", "bfloat16", "float32")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sdpa_math.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time every implementation side by side")
    r.add_argument("--device", choices=["cpu", "cuda"])
    r.add_argument("--set", choices=sorted(SETS))
    r.add_argument("--dtypes", nargs="+", choices=BENCH_DTYPES, default=list(BENCH_DTYPES), metavar="DTYPE",
                    help="space-separated, of " + ", ".join(BENCH_DTYPES))
    r.add_argument("--reps", type=int, default=15)
    r.add_argument("--no-backward", action="store_true")
    r.add_argument("--timing", choices=["gpu", "wall"], default="gpu",
                   help="CUDA samples: GPU time with the host's issuing hidden behind a spin kernel (gpu), or "
                        "a call issued to an idle GPU, host time included (wall)")
    r.add_argument("--out", default="bench-out")
    st = sub.add_parser("stats", help="time the statistics-only forward (col_sum + row_entropy) side by side")
    st.add_argument("--device", choices=["cpu", "cuda"])
    st.add_argument("--set", choices=sorted(SETS))
    st.add_argument("--dtypes", nargs="+", choices=BENCH_DTYPES, default=list(BENCH_DTYPES), metavar="DTYPE",
                    help="space-separated, of " + ", ".join(BENCH_DTYPES))
    st.add_argument("--reps", type=int, default=10)
    st.add_argument("--timing", choices=["gpu", "wall"], default="gpu")
    st.add_argument("--out", default="bench-out")
    g = sub.add_parser("gate", help="compare a run with a committed baseline")
    g.add_argument("run")
    g.add_argument("baseline")
    g.add_argument("--threshold", type=float, default=0.35,
                   help="allowed drop of a same-run ratio below the baseline's (CPU noise is ~20%%)")
    g.add_argument("--no-hash-check", action="store_true", help="do not require the run to match this tree")
    g.add_argument("--subset", action="store_true",
                   help="judge only the baseline's rows the run has (e.g. an anchors+variants run against an "
                        "anchors+sweep baseline); without it a baseline row missing from the run FAILs")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        _cmd_run(a)
        return 0
    if a.cmd == "stats":
        _cmd_stats(a)
        return 0
    return _cmd_gate(a)


if __name__ == "__main__":
    sys.exit(main())
