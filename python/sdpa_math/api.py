"""sdpa_math.attention: the contract of aten::_scaled_dot_product_attention_math."""
from __future__ import annotations

import torch

from ._ops import ops

_SEED_BOUND = 2**62


def _dropout_stream(device: torch.device) -> torch.Tensor:
    """A fresh (seed, offset) for random dropout, drawn on the inputs' device from PyTorch's
    generator for it, so torch.manual_seed (or torch.cuda.manual_seed) makes it reproducible.
    It stays on the device: the kernels read it there, so nothing waits for the GPU, a captured
    CUDA graph draws a new pair (a new mask) on each replay and torch.compile(fullgraph=True)
    traces it. The kernels draw element n of P from Philox(seed, offset)
    (include/sdpa_math/dropout_rng.h), so backward replays the same mask."""
    return torch.randint(0, _SEED_BOUND, (2,), dtype=torch.int64, device=device)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, dropout_mask: torch.Tensor | None = None, *,
              scale: float | None = None, enable_gqa: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output, attn_probs): O and the normalized probability map P.

    query (*batch, Hq, L, E), key (*batch, Hkv, S, E), value (*batch, Hkv, S, Ev). attn_mask is
    bool (True = attend) or float (added to the scores), broadcast to (*batch, Hq, L, S).
    is_causal: row i attends to keys j <= i (top-left aligned). scale: default 1/sqrt(E).
    dropout_mask (explicit dropout, any shape broadcasting to P): P = A * M, O = (A * M) V / (1 - p);
    without it, dropout_p > 0 draws a random mask from PyTorch's default generator's stream.
    enable_gqa: Hq a multiple of Hkv, query heads share key/value heads in groups.
    Gradients flow through both outputs (and into a float attn_mask that requires grad).
    The full rules and every error: docs/contract.md.
    """
    output, probs, _ = attention_with_lse(query, key, value, attn_mask, dropout_p, is_causal, dropout_mask,
                                          scale=scale, enable_gqa=enable_gqa)
    return output, probs


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                       dropout_mask: torch.Tensor | None = None, *, scale: float | None = None,
                       enable_gqa: bool = False, seed: int | None = None,
                       offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like attention(), also returning the row log-sum-exp (float32, float64 for float64
    inputs; -inf on fully masked rows),
    and taking an explicit dropout (seed, offset): the same pair gives the same mask on every
    device."""
    rng = None
    if seed is not None:
        rng = torch.tensor([seed, offset], dtype=torch.int64)  # read on the host by the op
    elif dropout_p > 0 and dropout_mask is None:
        rng = _dropout_stream(query.device)
    return ops.forward(query, key, value, attn_mask, float(dropout_p), bool(is_causal), dropout_mask,
                       None if scale is None else float(scale), bool(enable_gqa), rng)
