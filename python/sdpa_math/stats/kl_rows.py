"""kl_to's KL of one chunk's rows, Σ_j r log(r / P), by each route that computes it:

  _kl_rows_from_p            no graph, float32/float64 P (the operator's own P)
  _kl_rows_from_logits       no graph, fp16/bf16 inputs: log P from fp32 logits, never from the
                             rounded P
  _kl_rows_from_fp32_copies  no graph, fp16/bf16 inputs on the CPU: P in fp32 from the operator
                             run on fp32 copies (_fp32_on_cpu), the logits only for rows where
                             even that P underflows
  _kl_rows_with_graph        differentiable (the checkpointed chunks): log P from P, or from fp32
                             logits for fp16/bf16 inputs

_kl_rows_without_graph picks among the first three; the checkpointed chunks and _KLChunk's
forward both call it. Every route: terms with r = 0 are 0, +inf where r > 0 and P = 0."""
from __future__ import annotations

import torch

from .._ops import ops
from .logits import _log_probs_fp32, _shifted_logits_fp32, _widened_to

_HALF = (torch.float16, torch.bfloat16)


def _fp32_on_cpu(q, v, rows: int | None = None) -> bool:
    """Whether kl_to's chunk of fp16/bf16 inputs runs the operator on fp32 copies of q, k, v (and a
    float mask; _fp32_inputs): on the CPU, whose kernels load every dtype into fp32 and compute in
    fp32, so O and the lse are the operator's own (O rounded to the inputs' dtype as its kernel
    rounds it) and P comes in fp32, unrounded. kl_to needs P (or log P) in fp32; forming it from
    fp32 logits in PyTorch ops (a product, then the mask, max, exp and sums as separate passes)
    was the slower of the two on tens of query rows or more. With few rows the logits' passes are
    short and the copies of K and V are what costs: below Ev / 4 rows the logits are cheaper
    (bench/NOTES.md has the measurements)."""
    rows = q.shape[-2] if rows is None else rows  # the chunk's query rows
    return q.device.type == "cpu" and q.dtype in _HALF and 4 * rows >= v.shape[-1]


def _fp32_inputs(*tensors):
    """The tensors in fp32, a float mask too (a bool mask or None as it is), for _fp32_on_cpu."""
    return tuple(t.float() if t is not None and t.is_floating_point() else t for t in tensors)


def _forward_on_fp32_copies(q, k, v, m, is_causal, scale, enable_gqa):
    """(O in q's dtype, P in fp32, lse) of the operator run on fp32 copies of the inputs and a
    float mask m (_fp32_on_cpu), without a graph."""
    o, p, lse = ops.forward(*_fp32_inputs(q, k, v, m), 0.0, is_causal, None, scale, enable_gqa, None)
    return o.to(q.dtype), p, lse


def _kl_rows_with_graph(r, p, q, k, m, scale, enable_gqa):
    """Σ_j r log(r / P) per row, differentiable (the checkpointed chunks): log P from the fp32
    logits of q, k and the mask m for fp16/bf16 inputs (_log_probs_fp32), else from P; terms with
    r = 0 are 0, and so is the gradient to r there."""
    if q.dtype in _HALF:
        logp_fp32 = _log_probs_fp32(q, k, m, scale, enable_gqa)
        logp = torch.where(r > 0, logp_fp32, torch.zeros_like(logp_fp32))
    else:
        logp = torch.log(torch.where(r > 0, p.to(r.dtype), torch.ones_like(r)))
    # r log r with its gradient 0 where r = 0, as kl_to alone gives (xlogy's gradient to its
    # second argument, r / r, is NaN there): the logarithm only ever sees positive entries.
    positive = r > 0
    rlogr = torch.where(positive, r * torch.log(torch.where(positive, r, torch.ones_like(r))), torch.zeros_like(r))
    return (rlogr - r * logp).sum(-1)


def _kl_rows_from_p(r, p, lse):
    """Without a graph, float32/float64 P: Σ_j r log(r / P) per row; terms with r = 0 are 0, +inf
    where r > 0 and P = 0, NaN on a NaN row (lse NaN) where r has mass. r / P has 0/0 (r = 0 on a
    hidden key) made 0 and is floored at the smallest normal number, so a term with r = 0 is
    0 · log(tiny) = 0 and r > 0 over P = 0 stays +inf; a term whose true ratio is below the floor
    (r < tiny · P) is off by at most r · 88 (float32). The same NaN-to-0 turns a NaN row into
    log(tiny) · Σ r, nonzero exactly where r has mass: those rows are set back to NaN from the
    row's lse, without another L×S pass. One temporary, updated in place: on the CPU a fresh L×S
    temporary per step cost as much as the arithmetic (xlogy, where and log took several times
    this form's time)."""
    t = r / p.to(r.dtype)
    t.nan_to_num_(nan=0.0, posinf=float("inf")).clamp_min_(torch.finfo(r.dtype).tiny)
    kl = t.log_().mul_(r).sum(-1)
    return kl.masked_fill_(torch.isnan(lse) & (kl != 0), float("nan"))


def _kl_rows_from_logits(r, x):
    """Without a graph, fp16/bf16 inputs: Σ_j r log(r / P) per row with log P = x − lse from the
    fp32 logits x, shifted by their row max (_shifted_logits_fp32, so that the terms below stay
    small), as Σ r log r − Σ r x + R lse (R = Σ_j r), never forming log P: x is overwritten.
    Same rules as _kl_rows_from_p: r = 0 terms are 0; a hidden key (x = -inf) under r > 0 gives
    +inf, also on a row with no visible key."""
    x = _widened_to(x, r.shape)  # a reference with lead dims the logits lack
    R = r.sum(-1, dtype=torch.float32)
    lse = torch.logsumexp(x, -1)
    # r x with 0 · (-inf) = NaN made 0 (r = 0 on a hidden key); r > 0 there keeps -inf
    rx = x.mul_(r).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf")).sum(-1)
    rlogr = r.to(torch.float32, copy=True)  # a copy even when r is fp32: entr overwrites it
    rlogr = -torch.special.entr(rlogr, out=rlogr).sum(-1)
    kl = rlogr - rx + torch.where(R > 0, R * lse, 0.0)
    return torch.where(torch.isneginf(lse) & (R > 0), float("inf"), kl)


def _kl_rows_from_fp32_copies(ref, p, lse, q, k, m, scale, enable_gqa):
    """_kl_rows_from_p of fp16/bf16 inputs' P taken in fp32 (_fp32_on_cpu), keeping those inputs'
    rule that log P comes from the logits: a row whose KL is +inf from P (r > 0 where P underflows
    even in fp32, a logit gap past exp's range) takes its KL from the fp32 logits of q, k and the
    mask m (_kl_rows_from_logits), finite there; a row with r's mass on a hidden key is +inf
    either way. Rows of that kind are rare: the logits' passes run only when one is there."""
    kl = _kl_rows_from_p(ref.to(p.dtype), p, lse)
    inf = torch.isposinf(kl)
    if not inf.any():
        return kl
    return torch.where(inf, _kl_rows_from_logits(ref, _shifted_logits_fp32(q, k, m, scale, enable_gqa)).expand(kl.shape),
                       kl)


def _kl_rows_without_graph(ref, p, lse, q, k, m, scale, enable_gqa, stat_dtype, fp32_copies):
    """A chunk's KL rows with no graph, by the route its inputs take: fp32_copies (P and the lse
    came from the operator on fp32 copies of fp16/bf16 inputs, _fp32_on_cpu) -> from that P with
    the logits for underflowed rows; other fp16/bf16 inputs -> from the fp32 logits of q, k and the
    mask m, never the rounded P; float32/float64 -> from P itself. p and lse are the operator's for
    these rows, m their mask (the chunk's causal rows included); the result has P's lead shape
    (q, k and r may lack dims of v's)."""
    if fp32_copies:
        return _kl_rows_from_fp32_copies(ref, p, lse, q, k, m, scale, enable_gqa)
    if q.dtype in _HALF:
        return _kl_rows_from_logits(ref, _shifted_logits_fp32(q, k, m, scale, enable_gqa)).expand(p.shape[:-1])
    return _kl_rows_from_p(ref.to(stat_dtype), p, lse)
