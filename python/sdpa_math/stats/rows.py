"""Which query rows a chunk holds, and what hides keys from them: the chunk size, a mask's or a
reference's rows of a chunk, and the top-left causal rule for a chunk that starts past row 0."""
from __future__ import annotations

import torch

CHUNK_BYTES = 64 << 20  # the default chunk's P is at most this many bytes (one row at least)


def default_chunk_rows(n_lead: int, S: int, itemsize: int, L: int) -> int:
    """Rows per chunk so that the chunk's P, n_lead * rows * S * itemsize bytes, is at most
    CHUNK_BYTES (at least one row, at most L)."""
    per_row = max(1, n_lead * S * itemsize)
    return max(1, min(max(L, 1), CHUNK_BYTES // per_row))


def _rows_of(t: torch.Tensor | None, i0: int, i1: int) -> torch.Tensor | None:
    """Rows i0..i1 of a tensor broadcast to (..., L, S): sliced unless its row dim broadcasts."""
    if t is None or t.dim() < 2 or t.shape[-2] == 1:
        return t
    return t[..., i0:i1, :]


def _causal_rows(i0, i1, S, device):
    """Top-left causal visibility of rows i0..i1: row i sees keys j <= i."""
    return torch.arange(i0, i1, device=device)[:, None] >= torch.arange(S, device=device)[None, :]


def _op_causality(m, i0, is_causal):
    """(mask, is_causal) for the operator on a chunk of causal rows from i0 (m: their _causal_rows):
    the chunk from row 0 is causal in its own right (top-left), so it takes is_causal, whose kernels
    skip the hidden keys rather than reading a bool mask (measurably faster on the CPU); a later
    chunk's rows start past key 0 and take their bool rows. Not causal: (m, False)."""
    return (None, True) if is_causal and i0 == 0 else (m, False)
