"""kl_to alone with a gradient, off the fused CUDA route: one autograd function per chunk of query
rows (_KLChunk) that keeps the chunk's O and lse, never P, and forms the KL's gradient to the
logits directly."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._ops import ops
from .kl_rows import _forward_on_fp32_copies, _fp32_inputs, _fp32_on_cpu, _kl_rows_without_graph
from .logits import _logit_product_grads, _probs_fp32, _products_in_half
from .rows import _causal_rows, _op_causality


def _add(a, b):
    return b if a is None else a + b


class _KLChunk(torch.autograd.Function):
    """One chunk of query rows of kl_to when gradients are wanted: returns (O, KL) of the rows.

    The forward runs the operator once without a graph and keeps the chunk's inputs (views), its
    O and lse, never P. The backward recomputes P once and forms the KL's gradient to the logits
    directly, dS = g (Σ_j r · P − r) (g the KL's incoming gradient, r the reference's row), so
    dQ = scale dS K, dK = scale dSᵀ Q and a float mask's gradient is dS summed to its shape; O's
    gradient, when the caller uses O, goes through the operator's own backward. Autograd through a
    checkpointed chunk instead runs the KL's elementwise chain twice and then its backward, a
    clear loss against the math op on the CPU. For fp16/bf16 inputs both passes take P in fp32, so
    that neither it nor log P underflows or rounds with the inputs' dtype: on the CPU from the
    operator run on fp32 copies (_fp32_on_cpu), elsewhere from fp32 logits (_shifted_logits_fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, m, ref, causal_rows, scale, enable_gqa, stat_dtype):
        if causal_rows is not None:
            m = _causal_rows(*causal_rows, k.shape[-2], q.device)
        op_m, op_causal = _op_causality(m, causal_rows[0] if causal_rows else 0, causal_rows is not None)
        fp32 = _fp32_on_cpu(q, v)
        if fp32:  # O, the lse and P in fp32 from the CPU kernels
            o, p, lse = _forward_on_fp32_copies(q, k, v, op_m, op_causal, scale, enable_gqa)
        else:
            o, p, lse = ops.forward(q, k, v, op_m, 0.0, op_causal, None, scale, enable_gqa, None)
        kl = _kl_rows_without_graph(ref, p, lse, q, k, m, scale, enable_gqa, stat_dtype, fp32)
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
        # P and for the products: a decode chunk's cost is mostly passes over K.
        qk = (q, k)
        if fp32 or (half and not _products_in_half(q)):
            qk = (q.float(), k.float())
        grads = [None] * 5  # q, k, v, mask, reference
        p = None
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
            _add_kl_grads(grads, g, p, ref, q, k, m, qk, scale, enable_gqa, stat_dtype, fp32, logits,
                          (want_q, want_k, want_m, want_r))
        if want_v and grads[2] is None:  # V reaches the KL through nothing: zeros, as the operator's
            grads[2] = v.new_zeros(()).expand_as(v)  # backward gives, without writing a V-sized buffer
        return (*grads, None, None, None, None)


def _add_kl_grads(grads, g, p, ref, q, k, m, qk, scale, enable_gqa, stat_dtype, fp32, logits, wants):
    """Adds the KL's gradients, for the incoming g, to grads ([q, k, v, mask, reference]): p is the
    recomputed P (fp32 where fp32, None or unused where logits: P then comes from the fp32 logits
    of qk), qk the q and k the products take (widened where they run in fp32)."""
    want_q, want_k, want_m, want_r = wants
    r = ref.to(stat_dtype)
    logp = None
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
