"""Column sums, row entropy and chosen rows with no gradient wanted from one fused operator
(torch.ops.sdpa_math.forward_stats) that reduces P on chip or in cache and never writes it: on
the CPU for every input (src/cpu/stats.cpp), on CUDA where its kernels take the inputs (the decode
kernels for up to 4 query rows, the Hopper kernel for more; forward_stats_has_kernel says)."""
from __future__ import annotations

from .._ops import ops


def _forward_stats_applies(plan, query, key, value, attn_mask, tracked, method, count) -> bool:
    """Whether the fused operator gives what plan asks for: no gradient, no head_mean or kl_to,
    at least one of col_sum, row_entropy and rows, not method="chunks", and the CPU, or a CUDA
    kernel that takes these inputs (decode's, Hopper's). count: the window's rows."""
    return (not tracked and not plan.head_mean and not plan.kl
            and (plan.col_sum is not None or plan.row_entropy or plan.win is not None) and method != "chunks"
            and (query.device.type == "cpu"
                 or ops.forward_stats_has_kernel(query, key, value, attn_mask, plan.is_causal, plan.scale,
                                                 plan.enable_gqa, plan.col_sum is not None, plan.row_entropy, count)))


def _forward_stats_parts(plan, query, key, value, attn_mask, count) -> dict[str, list]:
    """The operator's one pass, as pieces by name for chunks._gather (one piece each)."""
    first, step = (plan.win[0], plan.win[2]) if plan.win is not None else (0, 1)
    o, _, cs_rows, ent_rows, win_rows = ops.forward_stats(query, key, value, attn_mask, plan.is_causal, plan.scale,
                                                          plan.enable_gqa, plan.col_sum is not None, plan.row_entropy,
                                                          first, count, step)
    parts = {"o": [o]}
    if plan.col_sum is not None:
        parts["col_sum"] = [cs_rows]
    if plan.row_entropy:
        parts["row_entropy"] = [ent_rows]
    if plan.win is not None and count > 0:
        parts["rows"] = [win_rows]
    return parts
