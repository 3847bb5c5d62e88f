"""`rows` alone on CUDA fp16/bf16 without a mask or gradient: O from PyTorch's fused kernel and
only the window's rows of P formed, as the softmax of their fp32 logits."""
from __future__ import annotations

import torch

from .._ops import ops
from .logits import _logits_fp32
from .pytorch_fused import _o_and_lse, _pytorch_fused_choice


def _rows_alone_applies(q, k, v, m, is_causal, scale, enable_gqa, col_sum, row_entropy, head_mean, kl_to,
                        tracked, count, S, fused) -> bool:
    """Whether `rows` alone takes _rows_alone: nothing else asked, no gradient, no mask, fp16/bf16
    CUDA inputs that one of PyTorch's fused kernels takes (it gives O), at least one key, and a
    window of at most a quarter of the query rows. The window's cost grows with its rows, the
    statistics kernel's with all rows: past a quarter of the rows the kernel was faster, and with
    a window of 1/16 of the rows or less this route was faster on every anchor. Up to 4 query rows
    (decode) take the decode kernels' statistics (one pass over K and V) where they apply (fused:
    the caller's answer from forward_stats_has_kernel), this route only where they do not: the
    decode kernels were the faster of the two there."""
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
    softmax_rows kernel: the operator's P there to rounding. Each row of P depends on its own
    query only. The operator itself on the window's rows was no faster than the statistics kernel
    over all rows on causal shapes (a 64-row window on a 4096-key causal shape sweeps every key
    tile twice in a handful of CTAs); this way the window costs PyTorch's forward plus one
    product and softmax_rows, which takes the mask, softmax and cast."""
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
