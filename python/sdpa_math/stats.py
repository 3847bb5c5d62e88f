"""Statistics of the probability map P without holding all of it (issue 16).

Two ways, the same statistics to rounding (docs/statistics.md). Column sums, row entropy and
chosen rows with no gradient wanted come from one fused operator (torch.ops.sdpa_math.forward_stats)
that reduces P on chip or in cache and never writes it: on the CPU for every input
(src/cpu/stats.cpp, extra memory O(B·H·(L + S))), on CUDA where its kernels take the inputs:
up to 4 query rows (decode) on the decode kernels of any GPU (src/cuda/decode.cu: fp16, bf16 and
fp32, K and V read once; the logits of at most 64 MiB of heads at a time in a workspace), more
rows on the Hopper kernel (src/cuda/sm90/forward_sm90.cu: fp16/bf16 as the Hopper forward takes
them; extra memory 4·B·H·⌈L/64⌉·S bytes for the column sums, at most 64 MiB at a time: a head
that needs more goes to the chunks). On CUDA, rows alone of more than 4 query rows (fp16/bf16, no
mask, no gradient, a window of at most a quarter of the rows) takes O from PyTorch's fused kernel and forms only the window's rows, as the
softmax of their fp32 logits (_rows_alone). Everything else runs sdpa_math.attention on chunks of
query rows, reduces each chunk's P to the statistics asked for, and drops it. With gradients, each chunk runs under
torch.utils.checkpoint (use_reentrant=False), so the graph keeps the chunk's inputs (views of
the caller's tensors and two integers) instead of its P, and backward recomputes one chunk's P
at a time: peak memory is O(chunk_rows * S) per head, and nothing P-sized outlives the forward.
kl_to alone with a gradient has its own autograd function per chunk (_KLChunk), which also keeps
the chunk's O and lse and forms the KL's gradient to the logits directly. On CUDA, where the
Hopper kernels take the inputs (no mask, the reference in the inputs' dtype), kl_to alone runs
whole, never forming P (_KLFused): O and lse from the fused kernel PyTorch's SDPA chooses (cuDNN,
flash or efficient attention; our statistics kernel where it chooses none or the inputs do not
suit it), the KL as Σ r log r − Σ r x + R lse from one pass over the reference that forms the
logits tile by tile (kl_forward; with fewer than 128 query rows or a reference TMA cannot read,
one product u = r K and a pass with kl_rows), and the gradient from the Hopper backward's KL
form, which recomputes P tile by tile from the lse.

Exact definitions, dtypes and the GQA and visible-queries rules: docs/statistics.md.
"""
from __future__ import annotations

import math
import warnings

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from ._ops import ops
from .api import attention, attention_with_lse

__all__ = ["attention_stats", "default_chunk_rows", "COL_SUM_MODES", "CHUNK_BYTES"]

COL_SUM_MODES = ("per_head", "group_sum", "group_mean")
CHUNK_BYTES = 64 << 20  # the default chunk's P is at most this many bytes (one row at least)


def default_chunk_rows(n_lead: int, S: int, itemsize: int, L: int) -> int:
    """Rows per chunk so that the chunk's P, n_lead * rows * S * itemsize bytes, is at most
    CHUNK_BYTES (at least one row, at most L)."""
    per_row = max(1, n_lead * S * itemsize)
    return max(1, min(max(L, 1), CHUNK_BYTES // per_row))


def _rows_of(t: torch.Tensor | None, i0: int, i1: int) -> torch.Tensor | None:
    """Rows i0..i1 of a tensor broadcast to (..., L, S): sliced unless its row dim broadcasts."""
    if t is None or t.dim() < 2 or t.shape[-2] == 1:
        return t
    return t[..., i0:i1, :]


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


def _kl_rows_autograd(r, p, logp_fp32):
    """Σ_j r log(r / P) per row, differentiable (the checkpointed chunks): log P from logp_fp32
    when given (fp16/bf16 inputs), else from P; terms with r = 0 are 0."""
    if logp_fp32 is not None:
        logp = torch.where(r > 0, logp_fp32, torch.zeros_like(logp_fp32))
    else:
        logp = torch.log(torch.where(r > 0, p.to(r.dtype), torch.ones_like(r)))
    return (torch.xlogy(r, r) - r * logp).sum(-1)


def _kl_rows(r, p, lse):
    """Without a graph, float32/float64 P: Σ_j r log(r / P) per row; terms with r = 0 are 0, +inf
    where r > 0 and P = 0, NaN on a NaN row (lse NaN) where r has mass. r / P has 0/0 (r = 0 on a
    hidden key) made 0 and is floored at the smallest normal number, so a term with r = 0 is
    0 · log(tiny) = 0 and r > 0 over P = 0 stays +inf; a term whose true ratio is below the floor
    (r < tiny · P) is off by at most r · 88 (float32). The same NaN-to-0 turns a NaN row into
    log(tiny) · Σ r, nonzero exactly where r has mass: those rows are set back to NaN from the
    row's lse, without another L×S pass. One temporary, updated in place: on the CPU a fresh L×S
    temporary per step cost as much as the arithmetic (this form took 0.21 ms where xlogy, where
    and log took 0.81, on 4 × 256 × 256 fp32)."""
    t = r / p.to(r.dtype)
    t.nan_to_num_(nan=0.0, posinf=float("inf")).clamp_min_(torch.finfo(r.dtype).tiny)
    kl = t.log_().mul_(r).sum(-1)
    return kl.masked_fill_(torch.isnan(lse) & (kl != 0), float("nan"))


def _kl_rows_from_logits(r, x):
    """Without a graph, fp16/bf16 inputs: Σ_j r log(r / P) per row with log P = x − lse from the
    fp32 logits x, shifted by their row max (_shifted_logits_fp32, so that the terms below stay
    small), as Σ r log r − Σ r x + R lse (R = Σ_j r), never forming log P: x is overwritten.
    Same rules as _kl_rows: r = 0 terms are 0; a hidden key (x = -inf) under r > 0 gives +inf,
    also on a row with no visible key."""
    x = _widened_to(x, r.shape)  # a reference with lead dims the logits lack
    R = r.sum(-1, dtype=torch.float32)
    lse = torch.logsumexp(x, -1)
    # r x with 0 · (-inf) = NaN made 0 (r = 0 on a hidden key); r > 0 there keeps -inf
    rx = x.mul_(r).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf")).sum(-1)
    rlogr = r.to(torch.float32, copy=True)  # a copy even when r is fp32: entr overwrites it
    rlogr = -torch.special.entr(rlogr, out=rlogr).sum(-1)
    kl = rlogr - rx + torch.where(R > 0, R * lse, 0.0)
    return torch.where(torch.isneginf(lse) & (R > 0), float("inf"), kl)


def _kl_rows_of_fp32_p(ref, p, lse, q, k, m, scale, enable_gqa):
    """_kl_rows of fp16/bf16 inputs' P taken in fp32 (_fp32_on_cpu), keeping those inputs' rule
    that log P comes from the logits: a row whose KL is +inf from P (r > 0 where P underflows
    even in fp32, a logit gap past exp's range) takes its KL from the fp32 logits of q, k and the
    mask m (_kl_rows_from_logits), finite there; a row with r's mass on a hidden key is +inf
    either way. Rows of that kind are rare: the logits' passes run only when one is there."""
    kl = _kl_rows(ref.to(p.dtype), p, lse)
    inf = torch.isposinf(kl)
    if not inf.any():
        return kl
    return torch.where(inf, _kl_rows_from_logits(ref, _shifted_logits_fp32(q, k, m, scale, enable_gqa)).expand(kl.shape),
                       kl)


def _causal_rows(i0, i1, S, device):
    """Top-left causal visibility of rows i0..i1: row i sees keys j <= i."""
    return torch.arange(i0, i1, device=device)[:, None] >= torch.arange(S, device=device)[None, :]


def _op_causality(m, i0, is_causal):
    """(mask, is_causal) for the operator on a chunk of causal rows from i0 (m: their _causal_rows):
    the chunk from row 0 is causal in its own right (top-left), so it takes is_causal, whose kernels
    skip the hidden keys; a later chunk's rows start past key 0 and take their bool rows. Not causal:
    (m, False). On the CPU a 512 x 512 causal chunk ran 2x slower as a bool mask (session 38)."""
    return (None, True) if is_causal and i0 == 0 else (m, False)


def _fp32_on_cpu(q, v, rows: int | None = None) -> bool:
    """Whether kl_to's chunk of fp16/bf16 inputs runs the operator on fp32 copies of q, k, v (and a
    float mask; _fp32_inputs): on the CPU, whose kernels load every dtype into fp32 and compute in
    fp32, so O and the lse are the operator's own (O rounded to the inputs' dtype as its kernel
    rounds it) and P comes in fp32, unrounded. kl_to needs P (or log P) in fp32; forming it from
    fp32 logits in PyTorch ops (a product, then the mask, max, exp and sums as separate passes)
    took kl_to's forward and backward in bf16 1.1-1.3x the time of this on 32-128 query rows
    (session 39). With few rows the logits' passes are short and the copies of K and V are
    what costs: below Ev / 4 rows the logits are cheaper (B=4 H=8 S=2048 Ev=64: one row 0.80x
    the time, 8 rows 0.93x, 16 rows 1.1x)."""
    rows = q.shape[-2] if rows is None else rows  # the chunk's query rows
    return q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16) and 4 * rows >= v.shape[-1]


def _fp32_inputs(*tensors):
    """The tensors in fp32, a float mask too (a bool mask or None as it is), for _fp32_on_cpu."""
    return tuple(t.float() if t is not None and t.is_floating_point() else t for t in tensors)


class _KLChunk(torch.autograd.Function):
    """One chunk of query rows of kl_to when gradients are wanted: returns (O, KL) of the rows.

    The forward runs the operator once without a graph and keeps the chunk's inputs (views), its
    O and lse, never P. The backward recomputes P once and forms the KL's gradient to the logits
    directly, dS = g (Σ_j r · P − r) (g the KL's incoming gradient, r the reference's row), so
    dQ = scale dS K, dK = scale dSᵀ Q and a float mask's gradient is dS summed to its shape; O's
    gradient, when the caller uses O, goes through the operator's own backward. Autograd through a
    checkpointed chunk instead ran the KL's elementwise chain twice and then its backward (0.67–0.79x
    the math op's speed on the CPU, session 18). For fp16/bf16 inputs both passes take P in fp32, so
    that neither it nor log P underflows or rounds with the inputs' dtype: on the CPU from the
    operator run on fp32 copies (_fp32_on_cpu), elsewhere from fp32 logits (_shifted_logits_fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, m, ref, causal_rows, scale, enable_gqa, stat_dtype):
        if causal_rows is not None:
            m = _causal_rows(*causal_rows, k.shape[-2], q.device)
        op_m, op_causal = _op_causality(m, causal_rows[0] if causal_rows else 0, causal_rows is not None)
        if _fp32_on_cpu(q, v):  # O, the lse and P in fp32 from the CPU kernels
            o, p, lse = ops.forward(*_fp32_inputs(q, k, v, op_m), 0.0, op_causal, None, scale, enable_gqa, None)
            o = o.to(q.dtype)
            kl = _kl_rows_of_fp32_p(ref, p, lse, q, k, m, scale, enable_gqa)
        else:
            o, p, lse = ops.forward(q, k, v, op_m, 0.0, op_causal, None, scale, enable_gqa, None)
            if p.dtype in (torch.float16, torch.bfloat16):  # to P's lead shape (q, k and r may lack dims of v's)
                kl = _kl_rows_from_logits(ref, _shifted_logits_fp32(q, k, m, scale, enable_gqa)).expand(p.shape[:-1])
            else:
                kl = _kl_rows(ref.to(stat_dtype), p, lse)
        if not any(ctx.needs_input_grad[:4]):  # only the reference needs a gradient: O has none
            ctx.mark_non_differentiable(o)
        ctx.save_for_backward(q, k, v, None if causal_rows is not None else m, ref, o, lse)
        ctx.meta = (causal_rows, scale, enable_gqa, stat_dtype)
        ctx.set_materialize_grads(False)
        return o, kl

    @staticmethod
    @once_differentiable  # double backward raises (as the operator's own, contract §11)
    def backward(ctx, d_o, g):
        q, k, v, m, ref, o, lse = ctx.saved_tensors
        causal_rows, scale, enable_gqa, stat_dtype = ctx.meta
        if causal_rows is not None:
            m = _causal_rows(*causal_rows, k.shape[-2], q.device)
        op_m, op_causal = _op_causality(m, causal_rows[0] if causal_rows else 0, causal_rows is not None)
        want_q, want_k, want_v, want_m, want_r = ctx.needs_input_grad[:5]
        want_m = want_m and m is not None and m.is_floating_point()
        half = q.dtype in (torch.float16, torch.bfloat16)
        fp32 = _fp32_on_cpu(q, v)
        logits = half and not fp32  # P from fp32 logits
        # Where the products run in fp32 too (not _products_in_half), q and k are widened once, for
        # P and for the products: a decode chunk's cost is mostly passes over K (session 39).
        qk = (q, k)
        if fp32 or (half and not _products_in_half(q)):
            qk = (q.float(), k.float())
        grads = [None] * 5  # q, k, v, mask, reference
        p = logp = None
        if fp32:  # P in fp32 (and rounded, the operator's P) from the CPU kernels
            _, p, _ = ops.forward(*qk, *_fp32_inputs(v, op_m), 0.0, op_causal, None, scale, enable_gqa, None)
        elif d_o is not None or not logits:
            _, p, _ = ops.forward(q, k, v, op_m, 0.0, op_causal, None, scale, enable_gqa, None)
        if d_o is not None:  # O's own gradient: the operator's backward from the recomputed P
            p_op = p.to(q.dtype) if fp32 else p
            dq, dk, dv, dm = ops.backward(d_o, None, q, k, v, op_m, lse, o, p_op, 0.0, op_causal, None, scale,
                                          enable_gqa, None, [want_q, want_k, want_v, want_m])
            grads[:4] = [t if want else None for t, want in zip((dq, dk, dv, dm), (want_q, want_k, want_v, want_m))]
        if g is not None and (want_q or want_k or want_m or want_r):
            r = ref.to(stat_dtype)
            if logits:  # P (and log P) in fp32 from fp32 logits, not the rounded P
                pf, logp = _probs_fp32(*qk, m, scale, enable_gqa, want_r)
            else:
                pf = p.to(stat_dtype)
            gs = g.to(stat_dtype).unsqueeze(-1)
            # dS = g (R P - r): the softmax's backward of dKL/dP = -r/P, with no division by P.
            ds = (r * -gs).addcmul_(pf, gs * r.sum(-1, keepdim=True))
            if want_q or want_k:
                products = (q, k) if _products_in_half(q) else qk
                dq, dk = _logit_product_grads(ds, *products, scale, enable_gqa)
                dq, dk = dq.to(q.dtype), dk.to(k.dtype)
                grads[0] = _add(grads[0], dq) if want_q else grads[0]
                grads[1] = _add(grads[1], dk) if want_k else grads[1]
            if want_m:
                grads[3] = _add(grads[3], ds.sum_to_size(m.shape).to(m.dtype))
            if want_r:  # d/dr of r log r - r log P: log r + 1 - log P where r > 0, else 0
                if logp is None:
                    logp = torch.log(torch.where(r > 0, pf, torch.ones_like(pf)))
                    if fp32 and (torch.isneginf(logp) & (r > 0)).any():  # P underflowed: log P from the logits
                        logp = torch.where(r > 0, _probs_fp32(*qk, m, scale, enable_gqa, True)[1], logp)
                dr = torch.where(r > 0, gs * (torch.log(torch.where(r > 0, r, torch.ones_like(r))) + 1 - logp),
                                 torch.zeros_like(r))
                grads[4] = dr.sum_to_size(ref.shape).to(ref.dtype)
        if want_v and grads[2] is None:  # V reaches the KL through nothing: zeros, as the operator's
            grads[2] = v.new_zeros(()).expand_as(v)  # backward gives, without writing a V-sized buffer
        return (*grads, None, None, None, None)


def _add(a, b):
    return b if a is None else a + b


def _o_grads_by_chunks(q, k, v, o, lse, d_o, is_causal, scale, enable_gqa, wants, chunk_rows=None):
    """[dQ, dK, dV] of Σ d_o · O (None where not wanted) through the operator's backward, one
    chunk of query rows at a time with the chunk's P recomputed (at most CHUNK_BYTES of it, as the
    chunked path holds; a causal chunk gets its rows of the top-left mask): a whole-problem P here
    would be an L×S buffer per head in the backward of the path that never forms P otherwise."""
    L, S = q.shape[-2], k.shape[-2]
    rows = chunk_rows or default_chunk_rows(math.prod(lse.shape[:-1]), S, q.element_size(), L)
    mask_wants = [*wants, False]
    dqs, dk, dv = [], None, None
    for i0 in range(0, L, rows):
        i1 = min(L, i0 + rows)
        rows_seen = _causal_rows(i0, i1, S, q.device) if is_causal and i0 > 0 else None  # not built for row 0's chunk
        m, causal = _op_causality(rows_seen, i0, is_causal)
        q_c = q[..., i0:i1, :]
        _, p_c, _ = ops.forward(q_c, k, v, m, 0.0, causal, None, scale, enable_gqa, None)
        dq_c, dk_c, dv_c, _ = ops.backward(d_o[..., i0:i1, :], None, q_c, k, v, m, lse[..., i0:i1], o[..., i0:i1, :],
                                           p_c, 0.0, causal, None, scale, enable_gqa, None, mask_wants)
        del p_c
        if wants[0]:
            dqs.append(dq_c)
        dk = _add(dk, dk_c) if wants[1] else None
        dv = _add(dv, dv_c) if wants[2] else None
    return [torch.cat(dqs, dim=-2) if wants[0] else None, dk, dv]


def _key_heads_of_group(lead, k, enable_gqa):
    """Hkv when GQA groups P's heads (lead[-1] query heads over k's Hkv key heads), else None."""
    if enable_gqa and k.dim() >= 3 and len(lead) >= 1 and lead[-1] != k.shape[-3]:
        return k.shape[-3]
    return None


def _ref_keys(r, k, enable_gqa):
    """u = r K per row, (*lead, L, E) in fp32: one product of the reference with K (fp32 results on
    the tensor cores, a GQA group's rows stacked against its key head). The KL's Σ_j r_ij x_ij over
    unmasked logits x = scale q kᵀ is scale · q_i · u_i, which kl_rows forms, instead of the L×S
    logits. r has P's shape."""
    lead, L, E = r.shape[:-2], r.shape[-2], k.shape[-1]
    hkv = _key_heads_of_group(lead, k, enable_gqa)
    if hkv is not None:
        return _bmm_fp32(r.reshape(lead[:-1] + (hkv, lead[-1] // hkv * L, r.shape[-1])), k).reshape(lead + (L, E))
    return _bmm_fp32(r, k)


def _ref_product_view(r, k, enable_gqa):
    """r (P's shape) as the batched matrices of _ref_keys' product r K (a GQA group's rows
    stacked), or None where that would copy r: lead dims that do not merge into one batch dim (a
    reference broadcast over heads, or in a (B, L, H, S) layout, with more than one batch) or rows
    cuBLAS cannot take as they are."""
    lead, (L, S) = r.shape[:-2], r.shape[-2:]
    if r.stride(-1) != 1 or r.stride(-2) < S:
        return None
    hkv = _key_heads_of_group(lead, k, enable_gqa)
    try:
        if hkv is not None:
            return r.view(lead[:-1] + (hkv, lead[-1] // hkv * L, S))
        return r.view((-1, L, S))
    except RuntimeError:
        return None


def _kl_fused_applies(q, k, v, m, ref, is_causal, scale, enable_gqa, lead):
    """How kl_to runs whole on the CUDA kernels (_KLFused), or None where it does not: fp16/bf16 on
    CUDA, no mask, the reference in the inputs' dtype and not itself differentiated, the
    statistics kernels take the inputs (O and lse without P), the Hopper backward's KL form takes
    the layout (torch.ops.sdpa_math.kl_backward_has_kernel, asked with placeholder rows), and the
    forward's rows have a route: "kl_forward" (its kernel, with 128 query rows or more and a
    layout TMA can address) or "r_k" (r K and kl_rows, for a layout r K needs no copy of). Not
    under torch.use_deterministic_algorithms(True) with a gradient: the KL form adds dQ with float
    atomics, while _KLChunk's products are deterministic."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and m is None and ref.dtype == q.dtype
            and _BMM_HAS_OUT_DTYPE and not _tracked(ref)):
        return None
    if _tracked(q, k, v) and torch.are_deterministic_algorithms_enabled():
        return None
    L, S = q.shape[-2], k.shape[-2]
    r = ref.expand(lead + (L, S))
    if not ops.forward_stats_has_kernel(q, k, v, None, is_causal, scale, enable_gqa, False, False, 0):
        return None
    rows = q.new_empty(lead + (L,), dtype=torch.float32)
    if L >= _KL_FORWARD_MIN_ROWS and ops.kl_forward_has_kernel(q, k, v, is_causal, scale, enable_gqa, rows, r):
        route = "kl_forward"
    elif _ref_product_view(r, k, enable_gqa) is not None:
        route = "r_k"
    else:
        return None
    if not ops.kl_backward_has_kernel(q, k, v, is_causal, scale, enable_gqa, rows, r, rows, rows):
        return None
    return route


# PyTorch's fused SDPA kernels that return the lse (torch.nn.attention.SDPBackend's numbering).
_FLASH, _EFFICIENT, _CUDNN = 1, 2, 3


def _pytorch_fused_choice(q, k, v, is_causal, scale, enable_gqa):
    """Which of PyTorch's fused CUDA kernels scaled_dot_product_attention would run for the
    unmasked problem under the current grad mode (torch._fused_sdp_choice: the user's enabled
    backends and each kernel's own rules), or 0 where none should: not CUDA, inputs not 4-dim of
    one batch (they broadcast nothing), and causal with L ≠ S (the contract's diagonal is
    top-left; kept off whatever a kernel's alignment)."""
    if not (q.is_cuda and q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]):
        return 0
    if is_causal and q.shape[-2] != k.shape[-2]:
        return 0
    with warnings.catch_warnings():  # its "kernel not used because ..." notes, when it declines
        warnings.simplefilter("ignore")
        try:
            return int(torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa))
        except RuntimeError:  # none of the enabled backends takes it (and the math op is disabled)
            return 0


def _o_and_lse(q, k, v, is_causal, scale, enable_gqa):
    """O and the lse (fp32, natural log, (B, H, L)) of the unmasked problem, without P: from the
    fused kernel PyTorch's own scaled_dot_product_attention would choose for a forward without
    gradient, where it returns an lse (on the H200 cuDNN's: 0.061 ms on prefill1k_d128 against
    0.111 for flash's and 0.160 for our statistics kernel's one pass, runs v58-v60), else, or
    where that kernel raises, from the statistics kernel with nothing asked."""
    choice = _pytorch_fused_choice(q, k, v, is_causal, scale, enable_gqa)
    out = None
    try:
        if choice == _FLASH:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        elif choice == _CUDNN:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False,
                                                                     scale=scale)
        elif choice == _EFFICIENT:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                         scale=scale)
    except RuntimeError:  # e.g. a library's own refusal of a layout its selector let through
        out = None
    if out is not None:
        o, lse = out[0], out[1]
        lse = lse[..., 0] if lse.dim() == 4 else lse  # cuDNN: (B, H, L, 1)
        lse = lse[..., :q.shape[-2]]  # efficient: rows padded to a multiple of 32
        if lse.shape == q.shape[:-1] and lse.dtype == torch.float32 and o.shape == q.shape[:-1] + (v.shape[-1],):
            return o, lse.contiguous()
    o, lse, *_ = ops.forward_stats(q, k, v, None, is_causal, scale, enable_gqa, False, False, 0, 0, 1)
    return o, lse


def _rows_alone_applies(q, k, v, m, is_causal, scale, enable_gqa, col_sum, row_entropy, head_mean, kl_to,
                        tracked, count, S, fused) -> bool:
    """Whether `rows` alone takes _rows_alone: nothing else asked, no gradient, no mask, fp16/bf16
    CUDA inputs that one of PyTorch's fused kernels takes (it gives O), at least one key, and a
    window of at most a quarter of the query rows. The window's cost grows with its rows, the
    statistics kernel's with all rows: tail100_d64's 64 of 100 rows took 0.101 ms this way against
    the kernel's 0.065; every anchor with a window of 1/16 of the rows or less ran faster. Up to 4
    query rows (decode) take the decode kernels' statistics (one pass over K and V) where they
    apply (fused: the caller's answer from forward_stats_has_kernel), this route only where they do
    not: decode_s2k_d128 took 0.396 ms this way (run s24-v79), 0.305 on the decode kernels (s37-v149)."""
    L = q.shape[-2]
    if not (col_sum is None and not row_entropy and not head_mean and kl_to is None and m is None and not tracked
            and 0 < count and S > 0 and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    if (L <= 4 and fused) or (L > 4 and 4 * count > L):
        return False
    return _pytorch_fused_choice(q, k, v, is_causal, scale, enable_gqa) != 0


def _rows_alone(q, k, v, is_causal, scale, enable_gqa, win):
    """(O, {"rows": P[..., rows, :]}) without sweeping P's other rows: O from PyTorch's fused kernel
    (_o_and_lse; its rounding, not the operator's), and the window's rows as the softmax of their
    fp32 logits (one product with fp32 results, a GQA group's rows stacked against their key
    head; causal: -inf right of each row's diagonal), rounded to P's dtype by the package's
    softmax_rows kernel: the operator's P there to rounding. Each row of P depends on its own query only. The operator itself on the window's
    rows was no faster than the statistics kernel over all rows on causal shapes (a 64-row window
    on long4k_d128_causal: 32 CTAs of 64 rows sweeping 4096 keys twice, run s24-v78); this way
    long4k's window costs PyTorch's forward (0.26 ms) plus ~0.075 ms of product, scale, softmax and
    cast as PyTorch ops (run s24-v81), of which softmax_rows takes the mask, softmax and cast."""
    start, stop, step = win
    o, _ = _o_and_lse(q, k, v, is_causal, scale, enable_gqa)
    B, Hq, _, E = q.shape
    Hkv = k.shape[-3]
    q_w = q[..., start:stop:step, :]
    w = q_w.shape[-2]
    S = k.shape[-2]
    grouped = q_w.reshape(B, Hkv, (Hq // Hkv) * w, E) if enable_gqa and Hq != Hkv else q_w
    x = _logits_fp32(grouped, k, None, scale, False).view(B, Hq, w, S)
    # The causal mask, softmax and cast in one kernel (torch.softmax of the masked logits, to q's
    # dtype): one write of P's rows after two reads of x, where separate ops took five passes.
    return o, {"rows": ops.softmax_rows(x, q.dtype, is_causal, start, step)}


# kl_forward's kernel takes 128 query rows a CTA and streams every key tile of K past them: with a
# handful of rows (decode) that is K read once per few rows at a fraction of copy bandwidth (runs
# v66, v69, decode_s2k_d128: 0.29-0.31 ms), where one thin product r K and kl_rows stream it once
# (0.13 ms, v71).
_KL_FORWARD_MIN_ROWS = 128


class _KLFused(torch.autograd.Function):
    """kl_to alone on CUDA, whole (no chunks), P never formed: returns (O, KL).

    Forward: O and lse without P (_o_and_lse), then KL = Σ r log r − Σ r x + R lse (+inf where r
    has mass on a hidden key) and R, by the route _kl_fused_applies chose: one pass over the
    reference that forms the logits x tile by tile (kl_forward's Hopper kernel), or, with fewer
    than 128 query rows or a reference TMA cannot read, u = r K (_ref_keys) and a streaming pass
    (kl_rows) with Σ r x = scale q·u. Backward: dQ and dK from the Hopper backward's KL form
    (dS = g (R P − r) with P recomputed from the lse per tile); O's gradient, when the loss uses O,
    through the operator's backward a chunk of query rows at a time (_o_grads_by_chunks)."""

    @staticmethod
    def forward(ctx, q, k, v, ref, is_causal, scale, enable_gqa, route):
        o, lse = _o_and_lse(q, k, v, is_causal, scale, enable_gqa)
        if route == "kl_forward":
            kl, R = ops.kl_forward(q, k, v, is_causal, scale, enable_gqa, lse, ref)
        else:  # few query rows, or a reference TMA cannot read: r K, then one pass
            lead, L, E = ref.shape[:-2], ref.shape[-2], q.shape[-1]
            kl, R = ops.kl_rows(ref, is_causal, q.expand(lead + (L, E)), _ref_keys(ref, k, enable_gqa), lse,
                                _scale_value(E, scale))
        ctx.save_for_backward(q, k, v, ref, o, lse, R)
        ctx.meta = (is_causal, scale, enable_gqa)
        ctx.set_materialize_grads(False)
        return o, kl

    @staticmethod
    @once_differentiable  # double backward raises (as the operator's own, contract §11)
    def backward(ctx, d_o, g):
        q, k, v, ref, o, lse, R = ctx.saved_tensors
        is_causal, scale, enable_gqa = ctx.meta
        want_q, want_k, want_v = ctx.needs_input_grad[:3]
        grads = [None] * 3
        if d_o is not None and (want_q or want_k or want_v):  # O's own gradient
            grads = _o_grads_by_chunks(q, k, v, o, lse, d_o, is_causal, scale, enable_gqa, (want_q, want_k, want_v))
        if g is not None and (want_q or want_k):
            dq, dk = ops.kl_backward(q, k, v, is_causal, scale, enable_gqa, lse, ref, R, g.float(), [want_q, want_k])
            grads[0] = _add(grads[0], dq) if want_q else grads[0]
            grads[1] = _add(grads[1], dk) if want_k else grads[1]
        if want_v and grads[2] is None:  # V reaches the KL through nothing
            grads[2] = v.new_zeros(()).expand_as(v)
        return (*grads, None, None, None, None, None)


def _cpu_bf16_products_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices faster than fp32 ones: it has AVX-512 BF16 or
    AMX. Without them PyTorch's bf16 products are emulated: on an AVX2 machine (AMD EPYC, 2
    threads) they ran 5x slower than fp32's, and kl_to's backward in bf16 took 0.30x the math op's
    time (bench/NOTES.md, session 38). The probes are PyTorch's own (private, so absent means no)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def _products_in_half(q) -> bool:
    """Whether _logit_product_grads multiplies fp16/bf16 inputs in their own dtype (see there)."""
    return (q.dtype in (torch.float16, torch.bfloat16) and _on_cuda(q)) or (
        q.dtype == torch.bfloat16 and _cpu_bf16_products_fast())


def _logit_product_grads(ds, q, k, scale, enable_gqa):
    """dQ = scale dS K and dK = scale dSᵀ Q, summed over a GQA group (the group's query rows are
    stacked, so the sum is inside dK's product) and over broadcast dims, from dS in the
    statistics dtype. Half-precision inputs multiply in their own dtype (dS rounded to it, as the
    math op's backward rounds its dS) where that is fast: fp16 and bf16 on CUDA (fp32 results
    where bmm has out_dtype), bf16 on a CPU with AVX-512 BF16 or AMX (4.7x fp32's speed with
    avx512_bf16 on the 2-core machine; _cpu_bf16_products_fast). fp16 on the CPU, and bf16 on a CPU
    without those, has no fast product (fp16 50x, bf16 5x slower than fp32 on an AVX2 machine) and
    multiplies in fp32. Before rounding to fp16 (with fp32 results only: an fp16 result could overflow), dS is
    scaled by a power of two per product matrix that brings its largest element near 1: dS is
    about S times smaller than the dQ it sums to, and a small loss (a mean over many rows) put it
    in fp16's subnormal range (a relative error 4x the fp32 path's, in a CPU emulation)."""
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
        # A power of two per product matrix (a key head's rows), exact and undone in fp32; its
        # exponent capped so that it stays finite in fp32 (dS below 2^-126 stays below 1).
        top = ds.abs().amax(dim=(-2, -1), keepdim=True)
        exponent = (-torch.floor(torch.log2(top))).clamp_(max=126)
        factor = torch.where((top > 0) & torch.isfinite(top), torch.exp2(exponent), 1.0)
        ds = ds * factor
    ds = ds.to(dtype)
    qq, kk = qf.to(dtype), k.to(dtype)
    if not (fast_half and _on_cuda(q)):
        # the scale on Q's rows, then dQ in place: not on dK, which for a decode chunk (S × E a
        # head) is far larger than dS (one row) — a fresh dK-sized temporary cost as much as its
        # product on the CPU
        dq = (ds @ kk).mul_(s)
        # one row a product (decode): dK is an outer product, which bmm with an inner dim of 1 ran
        # at half the speed of the broadcast multiply (same products, no sums; session 39)
        dk = ds.transpose(-2, -1) * (qq * s) if ds.shape[-2] == 1 else ds.transpose(-2, -1) @ (qq * s)
    else:  # fp32 results where bmm has out_dtype (else fp16/bf16 products, unscaled)
        mm = _bmm_fp32 if _BMM_HAS_OUT_DTYPE else (lambda x, y: (x @ y).float())
        c = s if factor is None else s / factor
        dq = mm(ds, kk).mul_(c)
        dk = mm(ds.transpose(-2, -1), qq).mul_(c)
    dq = dq.reshape(lead + (lc, q.shape[-1]))
    return dq.sum_to_size(q.shape).to(q.dtype), dk.sum_to_size(k.shape).to(k.dtype)


def _window(rows: slice, L: int) -> tuple[int, int, int]:
    if not isinstance(rows, slice):
        raise TypeError(f"attention_stats: rows must be a slice of query rows (e.g. slice(-w, None)), got {type(rows).__name__}")
    start, stop, step = rows.indices(L)
    if step < 1:
        raise ValueError(f"attention_stats: rows must have a positive step, got {step}")
    return start, max(start, stop), step


def _window_in_chunk(win: tuple[int, int, int], i0: int, i1: int) -> slice | None:
    """The chunk-local slice of the window's rows that fall in [i0, i1), or None."""
    start, stop, step = win
    first = start if start >= i0 else start + -(-(i0 - start) // step) * step
    end = min(stop, i1)
    if first >= end:
        return None
    return slice(first - i0, end - i0, step)


def attention_stats(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False, *,
                    scale: float | None = None, enable_gqa: bool = False,
                    col_sum: str | None = None, visible_normalized: bool = False,
                    row_entropy: bool = False, head_mean: bool = False,
                    rows: slice | None = None, kl_to: torch.Tensor | None = None,
                    chunk_rows: int | None = None, method: str = "auto") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (out, stats): O of sdpa_math.attention and the statistics of P asked for.

    Arguments up to enable_gqa are sdpa_math.attention's (dropout_p must be 0). P is the map
    attention returns, shape (*lead, L, S) with lead = (*batch, H). stats holds only the keys
    asked for; "stat dtype" is float64 for float64 inputs and float32 otherwise.

    col_sum: "per_head" -> (*lead, S), sum_i P[..., i, j];
        "group_sum" -> (*batch, Hkv, S), the per-head sums added over the H/Hkv query heads that
        read each key head; "group_mean" -> the same divided by H/Hkv.
    visible_normalized: divide each head's column sum by the number of rows i whose key j is
        not hidden (by causal, a bool False, or a float -inf), before the group reduction;
        0 where no row sees key j.
    row_entropy: (*lead, L), -sum_j P log P (0 log 0 = 0; fully masked rows give 0).
    rows: a slice of query rows (positive step, e.g. slice(-w, None)) -> P[..., rows, :] in
        P's dtype, (*lead, w, S).
    head_mean: (*batch, L, S), P averaged over the head dim (dim -3 of P).
    kl_to: a reference map broadcastable to P's shape -> (*lead, L),
        sum_j Pref log(Pref / P) (terms with Pref = 0 are 0; +inf where Pref > 0 and P = 0).
    chunk_rows: query rows per chunk; default: a chunk's P is at most 64 MiB.
    method: "auto" (the fused operator where it applies, else chunks; rows alone on CUDA
        fp16/bf16 without a mask or gradient: O from PyTorch's fused kernel and only the
        window's rows computed, _rows_alone), "fused" (raises
        ValueError where it does not apply: a gradient wanted or head_mean asked for, CUDA
        inputs its kernel does not take, or kl_to other than alone on CUDA inputs the Hopper
        kernels take), "chunks" (always the chunked composition).

    Every output is differentiable through q, k, v and a float mask (and kl_to's reference).
    """
    if dropout_p != 0:
        raise ValueError(
            f"attention_stats: dropout is not supported (dropout_p={dropout_p!r}): the statistics are those of the "
            "dropout-free map P = softmax(scale*QK^T + mask); call it with dropout_p=0.0")
    if col_sum is not None and col_sum not in COL_SUM_MODES:
        raise ValueError(f"attention_stats: col_sum must be None or one of {COL_SUM_MODES}, got {col_sum!r}")
    if visible_normalized and col_sum is None:
        raise ValueError("attention_stats: visible_normalized=True needs col_sum")
    if method not in ("auto", "fused", "chunks"):
        raise ValueError(f"attention_stats: method must be 'auto', 'fused' or 'chunks', got {method!r}")
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1):
        raise ValueError(f"attention_stats: chunk_rows must be a positive int, got {chunk_rows!r}")

    L, S = query.shape[-2], key.shape[-2]
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] not in (1, L):
        raise RuntimeError(f"attn_mask of shape {tuple(attn_mask.shape)} cannot be broadcast to the attention shape "
                           f"(*batch, Hq, L, S) with L = {L}")
    # A zero-row call: the operator validates every argument (its own errors, causal with a mask
    # included) and gives P's shape without computing anything.
    with torch.no_grad():
        o0, p0 = attention(query[..., :0, :], key, value, _rows_of(attn_mask, 0, 0), 0.0, is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    lead = tuple(p0.shape[:-2])
    p_dtype = p0.dtype
    stat_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    n_lead = math.prod(lead)
    if (col_sum in ("group_sum", "group_mean") or head_mean) and len(lead) < 1:
        raise ValueError("attention_stats: group column sums and head_mean need inputs with a head dim (3+ dims)")
    groups = None
    if col_sum in ("group_sum", "group_mean"):
        H = lead[-1]
        Hkv = key.shape[-3] if key.dim() >= 3 else 1
        if Hkv == 0 or H % Hkv:
            raise ValueError(f"attention_stats: key heads ({Hkv}) do not divide query heads ({H})")
        groups = (Hkv, H // Hkv)
    win = _window(rows, L) if rows is not None else None
    if kl_to is not None:
        try:
            ok = torch.broadcast_shapes(tuple(kl_to.shape), lead + (L, S)) == lead + (L, S)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"attention_stats: kl_to of shape {tuple(kl_to.shape)} does not broadcast to P's shape "
                             f"{lead + (L, S)}")
        if kl_to.dim() >= 2 and kl_to.shape[-2] not in (1, L):
            raise ValueError(f"attention_stats: kl_to has {kl_to.shape[-2]} rows, P has {L}")

    if chunk_rows is None:  # P's chunk in fp32 where kl_to takes it so (_fp32_on_cpu)
        p_bytes = 4 if kl_to is not None and _fp32_on_cpu(query, value) else p0.element_size()
        chunk_rows = default_chunk_rows(n_lead, S, p_bytes, L)
    bounds = [(i0, min(L, i0 + chunk_rows)) for i0 in range(0, L, chunk_rows)] or [(0, 0)]

    tensors = [t for t in (query, key, value, attn_mask, kl_to) if t is not None]
    use_checkpoint = _tracked(*tensors)

    # kl_to alone on CUDA's kernels, whole (_KLFused), with or without a gradient.
    if (kl_to is not None and col_sum is None and not row_entropy and not head_mean and win is None
            and method != "chunks" and (route := _kl_fused_applies(query, key, value, attn_mask, kl_to, is_causal,
                                                                   scale, enable_gqa, lead))):
        o, kl = _KLFused.apply(query, key, value, kl_to.expand(lead + (L, S)), is_causal, scale, enable_gqa, route)
        return o, {"kl_to": kl}
    # kl_to alone with a gradient elsewhere: its own autograd function per chunk (_KLChunk), not the checkpoint.
    kl_alone = (use_checkpoint and kl_to is not None and col_sum is None and not row_entropy and not head_mean
                and win is None)
    outs, cols, ents, kls, heads, picked = [], [], [], [], [], []
    first, count, step = (win[0], len(range(*win)), win[2]) if win is not None else (0, 0, 1)
    # The CPU operator takes every input; on CUDA, ask whether a kernel (decode's, Hopper's) takes these.
    fused_applies = (not use_checkpoint and not head_mean and kl_to is None
                     and (col_sum is not None or row_entropy or win is not None) and method != "chunks"
                     and (query.device.type == "cpu"
                          or ops.forward_stats_has_kernel(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                                          col_sum is not None, row_entropy, count)))
    # rows alone under auto, CUDA fp16/bf16, no mask, no gradient (_rows_alone_applies): O from
    # PyTorch's fused kernel and the window's rows from their own logits.
    if method == "auto" and win is not None and _rows_alone_applies(query, key, value, attn_mask, is_causal, scale,
                                                                    enable_gqa, col_sum, row_entropy, head_mean,
                                                                    kl_to, use_checkpoint, count, S, fused_applies):
        return _rows_alone(query, key, value, is_causal, scale, enable_gqa, win)
    if method == "fused" and not fused_applies:
        raise ValueError("attention_stats: method='fused' takes col_sum, row_entropy and rows with no gradient wanted, "
                         "of CPU inputs or of CUDA inputs its kernels take (torch.ops.sdpa_math."
                         "forward_stats_has_kernel), and kl_to alone on CUDA inputs the Hopper kernels take (fp16/bf16, "
                         "no mask, the reference in the inputs' dtype: torch.ops.sdpa_math.kl_backward_has_kernel); "
                         "use method='auto' for the chunked composition elsewhere")
    if fused_applies:
        o, _, cs_rows, ent_rows, win_rows = ops.forward_stats(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                                              col_sum is not None, row_entropy, first, count, step)
        outs.append(o)
        if col_sum is not None:
            cols.append(cs_rows)
        if row_entropy:
            ents.append(ent_rows)
        if win is not None and count > 0:
            picked.append(win_rows)
        bounds_to_run = []
    else:
        bounds_to_run = bounds
    # kl_to without a graph takes P in fp32 where the CPU route applies, decided once for the call
    # (by its largest chunk) so that every chunk's other statistics come from the same P.
    kl_fp32 = (kl_to is not None and not use_checkpoint
               and _fp32_on_cpu(query, value, max(i1 - i0 for i0, i1 in bounds)))
    for i0, i1 in bounds_to_run:
        sl = _window_in_chunk(win, i0, i1) if win is not None else None

        def chunk(q_c, k, v, m_c, ref_c, i0=i0, i1=i1, sl=sl):
            # Everything P-sized lives only inside this function (recomputed in backward).
            if is_causal:  # top-left: row i sees keys j <= i; built here so the graph does not keep it
                m_c = _causal_rows(i0, i1, S, q_c.device)
            op_m, op_causal = _op_causality(m_c, i0, is_causal)
            if kl_fp32:  # kl_to needs P in fp32: the CPU kernels give it (the other statistics use it too)
                o_c, pf, lse_c = attention_with_lse(*_fp32_inputs(q_c, k, v, op_m), 0.0, op_causal, scale=scale,
                                                    enable_gqa=enable_gqa)
                o_c = o_c.to(q_c.dtype)  # P in the inputs' dtype: only the window's rows (below)
            else:
                o_c, p_c, lse_c = attention_with_lse(q_c, k, v, op_m, 0.0, op_causal, scale=scale,
                                                     enable_gqa=enable_gqa)
                pf = p_c.to(stat_dtype)
            res = [o_c]
            if col_sum is not None:
                res.append(pf.sum(-2))
            if row_entropy:
                res.append(-(pf * torch.log(torch.where(pf > 0, pf, torch.ones_like(pf)))).sum(-1))
            if kl_to is not None:  # fp16/bf16: log P from fp32 P or fp32 logits, not from the rounded P
                half = q_c.dtype in (torch.float16, torch.bfloat16) and not kl_fp32
                if _tracked(q_c, k, m_c, ref_c):
                    res.append(_kl_rows_autograd(ref_c.to(stat_dtype), pf,
                                                 _log_probs_fp32(q_c, k, m_c, scale, enable_gqa) if half else None))
                elif half:
                    res.append(_kl_rows_from_logits(ref_c, _shifted_logits_fp32(q_c, k, m_c, scale, enable_gqa))
                               .expand(p_c.shape[:-1]))
                elif kl_fp32:
                    res.append(_kl_rows_of_fp32_p(ref_c, pf, lse_c, q_c, k, m_c, scale, enable_gqa))
                else:
                    res.append(_kl_rows(ref_c.to(stat_dtype), pf, lse_c))
            if head_mean:
                res.append(pf.mean(-3))
            if sl is not None:
                res.append(pf[..., sl, :].to(q_c.dtype) if kl_fp32 else p_c[..., sl, :].clone())
            return tuple(res)

        args = (query[..., i0:i1, :], key, value, None if is_causal else _rows_of(attn_mask, i0, i1),
                _rows_of(kl_to, i0, i1))
        if kl_alone:
            res = list(_KLChunk.apply(*args, (i0, i1) if is_causal else None, scale, enable_gqa, stat_dtype))
        elif use_checkpoint:
            res = list(checkpoint(chunk, *args, use_reentrant=False))
        else:
            res = list(chunk(*args))
        outs.append(res.pop(0))
        if col_sum is not None:
            cols.append(res.pop(0))
        if row_entropy:
            ents.append(res.pop(0))
        if kl_to is not None:
            kls.append(res.pop(0))
        if head_mean:
            heads.append(res.pop(0))
        if sl is not None:
            picked.append(res.pop(0))

    out = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
    stats: dict[str, torch.Tensor] = {}
    if col_sum is not None:
        cs = cols[0]
        for c in cols[1:]:
            cs = cs + c
        if visible_normalized:
            cnt = _visible_counts(attn_mask, is_causal, lead, L, S, bounds, query.device).to(stat_dtype)
            cs = torch.where(cnt > 0, cs / torch.where(cnt > 0, cnt, torch.ones_like(cnt)), torch.zeros_like(cs))
        if groups is not None:
            Hkv, G = groups
            cs = cs.unflatten(-2, (Hkv, G))
            cs = cs.sum(-2) if col_sum == "group_sum" else cs.mean(-2)
        stats["col_sum"] = cs
    if row_entropy:
        stats["row_entropy"] = torch.cat(ents, dim=-1)
    if kl_to is not None:
        stats["kl_to"] = torch.cat(kls, dim=-1)
    if head_mean:
        stats["head_mean"] = torch.cat(heads, dim=-2)
    if win is not None:
        stats["rows"] = torch.cat(picked, dim=-2) if picked else p0.new_empty(lead + (0, S))
    return out, stats


def _visible_counts(attn_mask, is_causal, lead, L, S, bounds, device) -> torch.Tensor:
    """(*lead, S) int64: how many rows i see key j (not hidden by causal, bool False or -inf)."""
    with torch.no_grad():
        if is_causal:  # rows i in [0, L) with i >= j
            cnt = (L - torch.arange(S, device=device)).clamp(min=0)
            return cnt.expand(lead + (S,))
        if attn_mask is None:
            return torch.full(lead + (S,), L, dtype=torch.int64, device=device)
        cnt = torch.zeros(lead + (S,), dtype=torch.int64, device=device)
        for i0, i1 in bounds:
            m = _rows_of(attn_mask, i0, i1)
            vis = m if m.dtype == torch.bool else m != float("-inf")
            cnt += vis.broadcast_to(lead + (i1 - i0, S)).sum(-2)
        return cnt
