"""kl_to alone on CUDA's kernels, whole (no chunks), P never formed (_KLFused), where the Hopper
kernels take the inputs (fp16/bf16, no mask, the reference in the inputs' dtype):

  forward   O and lse from PyTorch's fused kernel (_o_and_lse), then the KL as
            Σ r log r − Σ r x + R lse by one of two routes (_kl_fused_applies picks):
            "kl_forward"  one pass over the reference that forms the logits tile by tile
                          (the kl_forward kernel; 128 query rows or more, a layout TMA reads)
            "r_k"         u = r K, one thin product (_ref_keys), and a streaming pass (kl_rows)
                          with Σ r x = scale q·u: few query rows, or a reference TMA cannot read
  backward  dQ and dK from the Hopper backward's KL form (dS = g (R P − r), P recomputed per
            tile from the lse); O's gradient, when the loss uses O, through the operator's
            backward a chunk of query rows at a time (_o_grads_by_chunks)."""
from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .._ops import ops
from . import logits
from .kl_chunk import _add
from .logits import _scale_value, _tracked
from .pytorch_fused import _o_and_lse
from .rows import _causal_rows, _op_causality, default_chunk_rows

# kl_forward's kernel takes 128 query rows a CTA and streams every key tile of K past them: with a
# handful of rows (decode) that reads K once per few rows at a fraction of copy bandwidth, where
# one thin product r K and kl_rows stream it once (about twice as fast on decode shapes).
_KL_FORWARD_MIN_ROWS = 128


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
        return logits._bmm_fp32(r.reshape(lead[:-1] + (hkv, lead[-1] // hkv * L, r.shape[-1])), k).reshape(
            lead + (L, E))
    return logits._bmm_fp32(r, k)


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
            and logits._BMM_HAS_OUT_DTYPE and not _tracked(ref)):
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


def _kl_by_ref_keys(q, k, ref, lse, is_causal, scale, enable_gqa):
    """(KL, R) per row by the "r_k" route: u = r K (_ref_keys), then one pass of kl_rows."""
    lead, L, E = ref.shape[:-2], ref.shape[-2], q.shape[-1]
    return ops.kl_rows(ref, is_causal, q.expand(lead + (L, E)), _ref_keys(ref, k, enable_gqa), lse,
                       _scale_value(E, scale))


class _KLFused(torch.autograd.Function):
    """kl_to alone on CUDA, whole (no chunks), P never formed: returns (O, KL). The routes: this
    module's docstring."""

    @staticmethod
    def forward(ctx, q, k, v, ref, is_causal, scale, enable_gqa, route):
        o, lse = _o_and_lse(q, k, v, is_causal, scale, enable_gqa)
        if route == "kl_forward":
            kl, R = ops.kl_forward(q, k, v, is_causal, scale, enable_gqa, lse, ref)
        else:  # few query rows, or a reference TMA cannot read: r K, then one pass
            kl, R = _kl_by_ref_keys(q, k, ref, lse, is_causal, scale, enable_gqa)
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
