"""The logits x = scale · q kᵀ + mask in fp32, what kl_to forms from them (log P, P), and the
products of its gradient with K and Q (dQ, dK). Which product runs (half-precision operands with
fp32 results on CUDA, widened operands elsewhere) is decided here, in one module, so a test can
point _on_cuda, _BMM_HAS_OUT_DTYPE and _bmm_fp32 at the CPU or the meta device and run the CUDA
forms where no GPU is."""
from __future__ import annotations

import math

import torch

# bmm(..., out_dtype=torch.float32) of fp16/bf16 operands (CUDA only; PyTorch 2.11 has it, older
# releases may not): without it the operands are widened instead.
_BMM_HAS_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")


def _scale_value(E: int, scale):
    """The logits' scale as a number: the given one, else 1/√E (1 for E = 0, where every logit
    is 0)."""
    if scale is not None:
        return scale
    return 1.0 / math.sqrt(E) if E > 0 else 1.0


def _tracked(*tensors) -> bool:
    """Whether autograd records an op on these (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether kl_to takes its CUDA-only paths (tensor-core products) for t. One place, so a test
    can run those paths on the meta device where no GPU is (test_stats.py)."""
    return t.is_cuda


def _logits_fp32(q_c, k, m_c, scale, enable_gqa):
    """The chunk's logits in fp32, x = scale · q kᵀ + mask (-inf where a bool mask hides a key),
    from fp16/bf16 (or fp32) q and k. Without a graph, on CUDA, a half-precision product
    accumulates and returns fp32 on the tensor cores (bmm's out_dtype, where PyTorch has it; that
    overload has no derivative); elsewhere the operands are widened first. Either way each product
    of two rounded inputs is exact in fp32."""
    E = q_c.shape[-1]
    kk = k
    if enable_gqa and k.dim() >= 3 and q_c.dim() >= 3 and q_c.shape[-3] != k.shape[-3]:
        kk = k.repeat_interleave(q_c.shape[-3] // k.shape[-3], dim=-3)
    graph = _tracked(q_c, k, m_c)
    if not graph and _on_cuda(q_c) and q_c.dtype in (torch.float16, torch.bfloat16) and _BMM_HAS_OUT_DTYPE:
        x = _bmm_fp32(q_c, kk.transpose(-2, -1))
    else:
        x = q_c.float() @ kk.float().transpose(-2, -1)
    s = _scale_value(E, scale)
    if graph:
        if E > 0:
            x = x * s
        if m_c is not None:
            x = x.masked_fill(~m_c, float("-inf")) if m_c.dtype == torch.bool else x + m_c.float()
        return x
    if E > 0:  # no graph: the product's fresh buffer is updated in place
        x.mul_(s)
    if m_c is not None:
        x = _widened_to(x, m_c.shape)  # a mask with lead dims the logits lack (they came from v)
        x.masked_fill_(~m_c, float("-inf")) if m_c.dtype == torch.bool else x.add_(m_c)
    return x


def _bmm_fp32(a, b):
    """a @ b of half-precision operands with fp32 results (bmm's out_dtype), batch dims broadcast."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n = math.prod(batch)  # not -1: a zero-size batch or matrix has no inferable dim
    ab = a.expand(batch + a.shape[-2:]).reshape((n,) + a.shape[-2:])
    bb = b.expand(batch + b.shape[-2:]).reshape((n,) + b.shape[-2:])
    return torch.bmm(ab, bb, out_dtype=torch.float32).view(batch + (a.shape[-2], b.shape[-1]))


def _widened_to(x, shape):
    """x itself when an in-place op with an operand of `shape` keeps x's shape, else x broadcast
    to the joint shape in a fresh buffer."""
    joint = torch.broadcast_shapes(x.shape, shape)
    return x if joint == x.shape else x.expand(joint).clone()


def _log_probs_fp32(q_c, k, m_c, scale, enable_gqa):
    """log P of a chunk's rows from fp32 logits, differentiable, for kl_to on fp16/bf16 inputs
    under autograd: log P = x − logsumexp(x) with x from _logits_fp32. The log of the returned P
    would be -inf wherever P underflows in the inputs' dtype (below ~6e-8 in fp16), where the
    true value is finite. A row with no visible key gives -inf throughout (its P is 0) and no NaN
    in the gradient."""
    x = _logits_fp32(q_c, k, m_c, scale, enable_gqa)
    dead = torch.isneginf(x).all(-1, keepdim=True)
    logp = torch.log_softmax(torch.where(dead, torch.zeros_like(x), x), -1)
    return torch.where(dead, torch.full_like(logp, float("-inf")), logp)


def _shifted_logits_fp32(q_c, k, m_c, scale, enable_gqa):
    """Without a graph: the fp32 logits less their row max, x − max, in a fresh buffer the caller
    may overwrite (a row with no visible key stays -inf). Taking the max out first keeps
    log P = x − lse exact where every logit of a row sits near a float mask's finfo.min (a padding
    row): there lse = max + log S would round back to the max and lose the log S."""
    x = _logits_fp32(q_c, k, m_c, scale, enable_gqa)
    if x.shape[-1] == 0:  # no keys: nothing to shift (and no max to take)
        return x
    top = x.amax(-1, keepdim=True)
    return x.sub_(top.masked_fill_(torch.isneginf(top), 0.0))


def _probs_fp32(q_c, k, m_c, scale, enable_gqa, want_log):
    """Without a graph: P in fp32 from the fp32 logits, 0 on a row with no visible key; with
    want_log also log P = x − lse from the shifted logits (finite where P underflows in fp32,
    -inf on a hidden key and on a row with no visible key), else None."""
    x = _shifted_logits_fp32(q_c, k, m_c, scale, enable_gqa)
    if want_log:
        lse = torch.logsumexp(x, -1, keepdim=True)
        logp = (x - lse).masked_fill_(torch.isneginf(lse), float("-inf"))
        return torch.exp(logp), logp
    e = x.exp_()
    total = e.sum(-1, keepdim=True)
    return e.div_(total.masked_fill_(total == 0, 1.0)), None


def _cpu_bf16_products_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32 ones: it has AVX-512 BF16 or
    AMX. Without them PyTorch's bf16 products are emulated, several times slower than fp32's on
    an AVX2 machine (bench/NOTES.md). The probes are PyTorch's own (private, so absent means no)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _products_in_half(q) -> bool:
    """Whether _logit_product_grads multiplies fp16/bf16 inputs in their own dtype (see there)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and _on_cuda(q)) or (
        q.dtype == torch.bfloat16 and _cpu_bf16_products_fast())


def _fp16_power_of_two(ds):
    """dS scaled by a power of two per product matrix (a key head's rows) that brings its largest
    element near 1, and the factor: exact, and undone in fp32 after the product. dS is about S
    times smaller than the dQ it sums to, and a small loss (a mean over many rows) put it in fp16's
    subnormal range. The exponent is capped so that the factor stays finite in fp32 (a dS below
    2^-126 stays below 1)."""
    top = ds.abs().amax(dim=(-2, -1), keepdim=True)
    exponent = (-torch.floor(torch.log2(top))).clamp_(max=126)
    factor = torch.where((top > 0) & torch.isfinite(top), torch.exp2(exponent), 1.0)
    return ds * factor, factor


def _logit_product_grads(ds, q, k, scale, enable_gqa):
    """dQ = scale dS K and dK = scale dSᵀ Q, summed over a GQA group (the group's query rows are
    stacked, so the sum is inside dK's product) and over broadcast dims, from dS in the
    statistics dtype. Half-precision inputs multiply in their own dtype (dS rounded to it, as the
    math op's backward rounds its dS) where that is fast: fp16 and bf16 on CUDA (fp32 results
    where bmm has out_dtype), bf16 on a CPU with AVX-512 BF16 or AMX (_cpu_bf16_products_fast).
    fp16 on the CPU, and bf16 on a CPU without those, has no fast product (emulated, many times
    slower than fp32) and multiplies in fp32. Before rounding to fp16 (with fp32 results only: an
    fp16 result could overflow), dS is scaled by a power of two (_fp16_power_of_two)."""
    fast_half = _products_in_half(q)
    dtype = q.dtype if fast_half else ds.dtype
    s = _scale_value(q.shape[-1], scale)
    lead, lc, n_keys = ds.shape[:-2], ds.shape[-2], ds.shape[-1]
    grouped = enable_gqa and k.dim() >= 3 and q.dim() >= 3 and q.shape[-3] != k.shape[-3]
    qf = q
    if grouped:  # (*b, Hkv·G, Lc, ·) -> (*b, Hkv, G·Lc, ·): a group's rows against its key head
        hkv = k.shape[-3]
        g = q.shape[-3] // hkv
        ds = ds.reshape(lead[:-1] + (hkv, g * lc, n_keys))
        qf = q.reshape(q.shape[:-3] + (hkv, g * lc, q.shape[-1]))  # q's own batch dims: broadcast below
    factor = None
    if dtype == torch.float16 and _BMM_HAS_OUT_DTYPE and ds.numel() > 0:
        ds, factor = _fp16_power_of_two(ds)
    ds = ds.to(dtype)
    qq, kk = qf.to(dtype), k.to(dtype)
    if not (fast_half and _on_cuda(q)):
        # the scale on Q's rows, then dQ in place: not on dK, which for a decode chunk (S × E a
        # head) is far larger than dS (one row) — a fresh dK-sized temporary cost as much as its
        # product on the CPU
        dq = (ds @ kk).mul_(s)
        # one row a product (decode): dK is an outer product, which bmm with an inner dim of 1 ran
        # at about half the speed of the broadcast multiply (same products, no sums)
        dk = ds.transpose(-2, -1) * (qq * s) if ds.shape[-2] == 1 else ds.transpose(-2, -1) @ (qq * s)
    else:  # fp32 results where bmm has out_dtype (else fp16/bf16 products, unscaled)
        mm = _bmm_fp32 if _BMM_HAS_OUT_DTYPE else (lambda x, y: (x @ y).float())
        c = s if factor is None else s / factor
        dq = mm(ds, kk).mul_(c)
        dk = mm(ds.transpose(-2, -1), qq).mul_(c)
    dq = dq.reshape(lead + (lc, q.shape[-1]))
    return dq.sum_to_size(q.shape).to(q.dtype), dk.sum_to_size(k.shape).to(k.dtype)
