"""attention_stats: the arguments checked, P's shape found, and the route chosen (docs/statistics.md).

The routes, first that applies: kl_to alone on CUDA's kernels, whole (kl_cuda._KLFused); `rows`
alone on CUDA fp16/bf16 (rows_alone); the fused statistics operator (fused_operator); the chunked
composition (chunks), where kl_to alone with a gradient takes kl_chunk._KLChunk per chunk."""
from __future__ import annotations

import math

import torch

from ..api import attention
from .chunks import _gather, _Plan, _run_chunks
from .fused_operator import _forward_stats_applies, _forward_stats_parts
from .kl_cuda import _KLFused, _kl_fused_applies
from .kl_rows import _fp32_on_cpu
from .logits import _tracked
from .rows import _rows_of, default_chunk_rows
from .rows_alone import _rows_alone, _rows_alone_applies

COL_SUM_MODES = ("per_head", "group_sum", "group_mean")

_NOT_FUSED = ("attention_stats: method='fused' takes col_sum, row_entropy and rows with no gradient wanted, "
              "of CPU inputs or of CUDA inputs its kernels take (torch.ops.sdpa_math."
              "forward_stats_has_kernel), and kl_to alone on CUDA inputs the Hopper kernels take (fp16/bf16, "
              "no mask, the reference in the inputs' dtype: torch.ops.sdpa_math.kl_backward_has_kernel); "
              "use method='auto' for the chunked composition elsewhere")


def attention_stats(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False, *,
                    scale: float | None = None, enable_gqa: bool = False,
                    col_sum: str | None = None, visible_normalized: bool = False,
                    row_entropy: bool = False, head_mean: bool = False,
                    rows: slice | None = None, kl_to: torch.Tensor | None = None,
                    heads=None, chunk_rows: int | None = None, method: str = "auto") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    heads: query heads to compute (a sequence of indices into the head dim, dim -3 of q and P):
        everything, O included, is then that of q[..., heads, :, :] with each head's own key
        head (its GQA group's), mask and reference rows, and only those heads are computed
        (Whisper's alignment heads are a few of a layer's). head_mean averages the chosen heads;
        group column sums are refused with heads (a group would be partly chosen).
    chunk_rows: query rows per chunk; default: a chunk's P is at most 64 MiB.
    method: "auto" (the fused operator where it applies, else chunks; rows alone on CUDA
        fp16/bf16 without a mask or gradient: O from PyTorch's fused kernel and only the
        window's rows computed, _rows_alone), "fused" (raises
        ValueError where it does not apply: a gradient wanted or head_mean asked for, CUDA
        inputs its kernel does not take, or kl_to other than alone on CUDA inputs the Hopper
        kernels take), "chunks" (always the chunked composition).

    Every output is differentiable through q, k, v and a float mask (and kl_to's reference).
    """
    _check_options(dropout_p, col_sum, visible_normalized, method, chunk_rows)
    if heads is not None:
        if col_sum in ("group_sum", "group_mean"):
            raise ValueError("attention_stats: heads with group column sums: a GQA group would be partly chosen; "
                             "ask for col_sum='per_head' and add the chosen heads' sums")
        query, key, value, attn_mask, kl_to, enable_gqa = _select_heads(heads, query, key, value, attn_mask, kl_to,
                                                                        enable_gqa)
    plan, p0 = _plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, col_sum, visible_normalized,
                     row_entropy, head_mean, rows, kl_to)
    lead, L, S, win = plan.lead, plan.L, plan.S, plan.win
    tracked = _tracked(query, key, value, attn_mask, kl_to)
    # kl_to alone on CUDA's kernels, whole, with or without a gradient: P is never formed
    if (plan.kl and col_sum is None and not row_entropy and not head_mean and win is None and method != "chunks"
            and (route := _kl_fused_applies(query, key, value, attn_mask, kl_to, is_causal, scale, enable_gqa,
                                            lead))):
        o, kl = _KLFused.apply(query, key, value, kl_to.expand(lead + (L, S)), is_causal, scale, enable_gqa, route)
        return o, {"kl_to": kl}
    count = len(range(*win)) if win is not None else 0
    fused = _forward_stats_applies(plan, query, key, value, attn_mask, tracked, method, count)
    # rows alone (auto): O from PyTorch's fused kernel, and only the window's rows of P formed
    if method == "auto" and win is not None and _rows_alone_applies(query, key, value, attn_mask, is_causal, scale,
                                                                    enable_gqa, col_sum, row_entropy, head_mean,
                                                                    kl_to, tracked, count, S, fused):
        return _rows_alone(query, key, value, is_causal, scale, enable_gqa, win)
    if method == "fused" and not fused:
        raise ValueError(_NOT_FUSED)
    if chunk_rows is None:  # P's chunk in fp32 where kl_to takes it so (_fp32_on_cpu)
        p_bytes = 4 if plan.kl and _fp32_on_cpu(query, value) else p0.element_size()
        chunk_rows = default_chunk_rows(math.prod(lead), S, p_bytes, L)
    bounds = [(i0, min(L, i0 + chunk_rows)) for i0 in range(0, L, chunk_rows)] or [(0, 0)]
    if fused:
        parts = _forward_stats_parts(plan, query, key, value, attn_mask, count)
    else:
        parts = _run_chunks(plan, bounds, query, key, value, attn_mask, kl_to)
    return _gather(plan, parts, p0, attn_mask, bounds, query.device)


def _select_heads(heads, query, key, value, attn_mask, kl_to, enable_gqa):
    """The problem of the chosen query heads alone: q's heads (dim -3) indexed, each paired with its
    own key and value head (its GQA group's, or the one head all share), the mask's and the
    reference's heads where they have their own; then no GQA is left to resolve."""
    if query.dim() < 3:
        raise ValueError(f"attention_stats: heads needs inputs with a head dim (3+ dims), got q of shape "
                         f"{tuple(query.shape)}")
    H = query.shape[-3]
    try:
        chosen = [int(h) for h in heads]
    except TypeError:
        raise TypeError(f"attention_stats: heads must be a sequence of head indices, got {type(heads).__name__}") \
            from None
    if not chosen or any(isinstance(h, bool) or not -H <= int(h) < H for h in heads):
        raise ValueError(f"attention_stats: heads must be a non-empty sequence of indices in [-{H}, {H}), got "
                         f"{list(heads)!r}")
    idx = torch.tensor([h % H for h in chosen], device=query.device)

    def own_heads(t, groups_of):  # t's heads for the chosen query heads, where t has heads of its own
        if t is None or t.dim() < 3 or t.shape[-3] == 1:
            return t
        n = t.shape[-3]
        if n == H:
            return t.index_select(-3, idx)
        if groups_of and n and H % n == 0:
            return t.index_select(-3, torch.div(idx, H // n, rounding_mode="floor"))
        return t  # a shape the operator itself refuses, with its own error

    gqa = enable_gqa and key.dim() >= 3 and key.shape[-3] not in (H, 1)
    return (query.index_select(-3, idx), own_heads(key, gqa), own_heads(value, gqa), own_heads(attn_mask, False),
            own_heads(kl_to, False), enable_gqa and not gqa)


def _check_options(dropout_p, col_sum, visible_normalized, method, chunk_rows):
    """Raises on an argument that is wrong whatever the tensors."""
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


def _plan(query, key, value, attn_mask, is_causal, scale, enable_gqa, col_sum, visible_normalized, row_entropy,
          head_mean, rows, kl_to) -> tuple[_Plan, torch.Tensor]:
    """(the call's _Plan, a zero-row P): the tensors' shapes checked against what is asked."""
    L, S = query.shape[-2], key.shape[-2]
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] not in (1, L):
        raise RuntimeError(f"attn_mask of shape {tuple(attn_mask.shape)} cannot be broadcast to the attention shape "
                           f"(*batch, Hq, L, S) with L = {L}")
    # A zero-row call: the operator validates every argument (its own errors, causal with a mask
    # included) and gives P's shape without computing anything.
    with torch.no_grad():
        _, p0 = attention(query[..., :0, :], key, value, _rows_of(attn_mask, 0, 0), 0.0, is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    lead = tuple(p0.shape[:-2])
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
        _check_reference(kl_to, lead, L, S)
    stat_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    plan = _Plan(col_sum=col_sum, visible_normalized=visible_normalized, groups=groups, row_entropy=row_entropy,
                 kl=kl_to is not None, head_mean=head_mean, win=win, is_causal=is_causal, scale=scale,
                 enable_gqa=enable_gqa, stat_dtype=stat_dtype, lead=lead, L=L, S=S)
    return plan, p0


def _check_reference(kl_to, lead, L, S):
    """Raises unless kl_to broadcasts to P's shape (*lead, L, S) with its own rows (or one)."""
    try:
        ok = torch.broadcast_shapes(tuple(kl_to.shape), lead + (L, S)) == lead + (L, S)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"attention_stats: kl_to of shape {tuple(kl_to.shape)} does not broadcast to P's shape "
                         f"{lead + (L, S)}")
    if kl_to.dim() >= 2 and kl_to.shape[-2] not in (1, L):
        raise ValueError(f"attention_stats: kl_to has {kl_to.shape[-2]} rows, P has {L}")


def _window(rows: slice, L: int) -> tuple[int, int, int]:
    if not isinstance(rows, slice):
        raise TypeError(f"attention_stats: rows must be a slice of query rows (e.g. slice(-w, None)), got {type(rows).__name__}")
    start, stop, step = rows.indices(L)
    if step < 1:
        raise ValueError(f"attention_stats: rows must have a positive step, got {step}")
    return start, max(start, stop), step
