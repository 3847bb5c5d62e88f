"""sdpa_math.attention: the contract of aten::_scaled_dot_product_attention_math."""
from __future__ import annotations

import torch

from ._ops import ops

_SEED_BOUND = 2**62


def _dropout_stream() -> tuple[int, int]:
    """A fresh (seed, offset) for random dropout, drawn from PyTorch's default CPU generator so
    that torch.manual_seed makes it reproducible. The kernels draw element n of P from
    Philox(seed, offset) (include/sdpa_math/dropout_rng.h), so backward replays the same mask."""
    seed = int(torch.randint(0, _SEED_BOUND, (), dtype=torch.int64).item())
    return seed, 0


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, dropout_mask=None, *,
              scale=None, enable_gqa=False):
    """Returns (output, attn_probs): O and the normalized probability map P.

    query (*batch, Hq, L, E), key (*batch, Hkv, S, E), value (*batch, Hkv, S, Ev). attn_mask is
    bool (True = attend) or float (added to the scores), broadcast to (*batch, Hq, L, S).
    Gradients flow through both outputs (and into a float attn_mask that requires grad).
    """
    output, probs, _ = attention_with_lse(query, key, value, attn_mask, dropout_p, is_causal, dropout_mask,
                                          scale=scale, enable_gqa=enable_gqa)
    return output, probs


def attention_with_lse(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, dropout_mask=None, *,
                       scale=None, enable_gqa=False, seed=None, offset=0):
    """Like attention(), also returning the row log-sum-exp (float32, float64 for float64
    inputs; -inf on fully masked rows),
    and taking an explicit dropout (seed, offset)."""
    if seed is None:
        seed, offset = _dropout_stream() if (dropout_p > 0 and dropout_mask is None) else (0, 0)
    return ops.forward(query, key, value, attn_mask, float(dropout_p), bool(is_causal), dropout_mask,
                       None if scale is None else float(scale), bool(enable_gqa), int(seed), int(offset))
