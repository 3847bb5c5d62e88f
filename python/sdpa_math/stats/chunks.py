"""The chunked composition: sdpa_math.attention on chunks of query rows, each chunk's P reduced
to the statistics asked for and dropped, then the chunks' pieces gathered into the statistics.

With gradients, each chunk runs under torch.utils.checkpoint (use_reentrant=False), so the graph
keeps the chunk's inputs (views of the caller's tensors and two integers) instead of its P, and
backward recomputes one chunk's P at a time: peak memory is O(chunk_rows * S) per head, and
nothing P-sized outlives the forward. kl_to alone with a gradient has its own autograd function
per chunk instead (_KLChunk)."""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..api import attention_with_lse
from .kl_chunk import _KLChunk
from .kl_rows import _forward_on_fp32_copies, _fp32_on_cpu, _kl_rows_with_graph, _kl_rows_without_graph
from .logits import _tracked
from .rows import _causal_rows, _op_causality, _rows_of


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a call asks for and the problem's settings, as the chunks and the gathering need them."""
    col_sum: str | None
    visible_normalized: bool
    groups: tuple[int, int] | None  # (Hkv, G) for the group column sums
    row_entropy: bool
    kl: bool
    head_mean: bool
    win: tuple[int, int, int] | None  # the rows window (start, stop, step)
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    stat_dtype: torch.dtype
    lead: tuple[int, ...]
    L: int
    S: int

    def outputs(self, with_rows: bool) -> list[str]:
        """The names of a chunk's results, in the order the chunk returns them."""
        names = ["o"] + ["col_sum"] * (self.col_sum is not None) + ["row_entropy"] * self.row_entropy
        return names + ["kl_to"] * self.kl + ["head_mean"] * self.head_mean + ["rows"] * with_rows


def _window_in_chunk(win: tuple[int, int, int], i0: int, i1: int) -> slice | None:
    """The chunk-local slice of the window's rows that fall in [i0, i1), or None."""
    start, stop, step = win
    first = start if start >= i0 else start + -(-(i0 - start) // step) * step
    end = min(stop, i1)
    if first >= end:
        return None
    return slice(first - i0, end - i0, step)


def _chunk_stats(plan: _Plan, kl_fp32: bool, i0: int, i1: int, sl: slice | None, q_c, k, v, m_c, ref_c):
    """The statistics of rows i0..i1 (plan.outputs' order). Everything P-sized lives only inside
    this function (recomputed in backward). kl_fp32: the operator runs on fp32 copies of fp16/bf16
    inputs (_fp32_on_cpu), so kl_to takes P in fp32, and the other statistics use it too."""
    if plan.is_causal:  # top-left: row i sees keys j <= i; built here so the graph does not keep it
        m_c = _causal_rows(i0, i1, plan.S, q_c.device)
    op_m, op_causal = _op_causality(m_c, i0, plan.is_causal)
    scale, gqa = plan.scale, plan.enable_gqa
    if kl_fp32:  # P stays in fp32: only the window's rows are rounded to the inputs' dtype (below)
        o_c, pf, lse_c = _forward_on_fp32_copies(q_c, k, v, op_m, op_causal, scale, gqa)
    else:
        o_c, p_c, lse_c = attention_with_lse(q_c, k, v, op_m, 0.0, op_causal, scale=scale, enable_gqa=gqa)
        pf = p_c.to(plan.stat_dtype)
    res = [o_c]
    if plan.col_sum is not None:
        res.append(pf.sum(-2))
    if plan.row_entropy:
        res.append(-(pf * torch.log(torch.where(pf > 0, pf, torch.ones_like(pf)))).sum(-1))
    if plan.kl:
        if _tracked(q_c, k, m_c, ref_c):
            res.append(_kl_rows_with_graph(ref_c.to(plan.stat_dtype), pf, q_c, k, m_c, scale, gqa))
        else:
            res.append(_kl_rows_without_graph(ref_c, pf, lse_c, q_c, k, m_c, scale, gqa, plan.stat_dtype, kl_fp32))
    if plan.head_mean:
        res.append(pf.mean(-3))
    if sl is not None:
        res.append(pf[..., sl, :].to(q_c.dtype) if kl_fp32 else p_c[..., sl, :].clone())
    return tuple(res)


def _run_chunks(plan: _Plan, bounds, query, key, value, attn_mask, kl_to) -> dict[str, list]:
    """Each chunk's pieces by name (plan.outputs). With a gradient: kl_to alone takes _KLChunk,
    anything else the checkpointed chunks."""
    use_checkpoint = _tracked(query, key, value, attn_mask, kl_to)
    kl_alone = (use_checkpoint and plan.kl and plan.col_sum is None and not plan.row_entropy and not plan.head_mean
                and plan.win is None)
    # kl_to without a graph takes P in fp32 where the CPU route applies, decided once for the call
    # (by its largest chunk) so that every chunk's other statistics come from the same P.
    kl_fp32 = plan.kl and not use_checkpoint and _fp32_on_cpu(query, value, max(i1 - i0 for i0, i1 in bounds))
    parts = {name: [] for name in plan.outputs(plan.win is not None)}
    for i0, i1 in bounds:
        sl = _window_in_chunk(plan.win, i0, i1) if plan.win is not None else None
        args = (query[..., i0:i1, :], key, value, None if plan.is_causal else _rows_of(attn_mask, i0, i1),
                _rows_of(kl_to, i0, i1))
        if kl_alone:
            res = _KLChunk.apply(*args, (i0, i1) if plan.is_causal else None, plan.scale, plan.enable_gqa,
                                 plan.stat_dtype)
        elif use_checkpoint:
            res = checkpoint(functools.partial(_chunk_stats, plan, kl_fp32, i0, i1, sl), *args, use_reentrant=False)
        else:
            res = _chunk_stats(plan, kl_fp32, i0, i1, sl, *args)
        for name, t in zip(plan.outputs(sl is not None), res):
            parts[name].append(t)
    return parts


def _gather(plan: _Plan, parts: dict[str, list], p0, attn_mask, bounds, device):
    """(O, stats) from the pieces of the chunks (or of the fused operator's one pass): column sums
    added (then divided by the visible counts, then reduced over a GQA group), rows joined. p0:
    a zero-row P, for an empty window's dtype and device."""
    outs = parts["o"]
    out = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
    stats: dict[str, torch.Tensor] = {}
    if plan.col_sum is not None:
        cols = parts["col_sum"]
        cs = cols[0]
        for c in cols[1:]:
            cs = cs + c
        if plan.visible_normalized:
            cnt = _visible_counts(attn_mask, plan.is_causal, plan.lead, plan.L, plan.S, bounds, device)
            cnt = cnt.to(plan.stat_dtype)
            cs = torch.where(cnt > 0, cs / torch.where(cnt > 0, cnt, torch.ones_like(cnt)), torch.zeros_like(cs))
        if plan.groups is not None:
            Hkv, G = plan.groups
            cs = cs.unflatten(-2, (Hkv, G))
            cs = cs.sum(-2) if plan.col_sum == "group_sum" else cs.mean(-2)
        stats["col_sum"] = cs
    if plan.row_entropy:
        stats["row_entropy"] = torch.cat(parts["row_entropy"], dim=-1)
    if plan.kl:
        stats["kl_to"] = torch.cat(parts["kl_to"], dim=-1)
    if plan.head_mean:
        stats["head_mean"] = torch.cat(parts["head_mean"], dim=-2)
    if plan.win is not None:
        picked = parts.get("rows", [])
        stats["rows"] = torch.cat(picked, dim=-2) if picked else p0.new_empty(plan.lead + (0, plan.S))
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
