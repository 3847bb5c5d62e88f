"""O and the lse of an unmasked CUDA problem without P, from the fused kernel PyTorch's own
scaled_dot_product_attention would choose (cuDNN, flash or efficient attention), else from the
package's statistics kernel: what kl_to's fused route and `rows` alone take their O from."""
from __future__ import annotations

import warnings

import torch

from .._ops import ops

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
    gradient, where it returns an lse (on Hopper cuDNN's and flash's forwards beat one pass of
    our statistics kernel; bench/NOTES.md), else, or where that kernel raises, from the
    statistics kernel with nothing asked."""
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
