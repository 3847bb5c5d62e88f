"""kvpress presses whose attention scores come from sdpa_math's fused statistics (issue 47).

NVIDIA's kvpress (PyPI `kvpress`, 0.5.5) compresses a model's KV cache after the prefill by
scoring every key and keeping the best. Three of its presses score keys by the attention they
receive, and each gets those scores by holding a piece of the probability map P:

* ObservedAttentionPress (H2O): the whole (B, H, L, S) map that eager attention returns, summed
  over queries;
* SnapKVPress: the last `window_size` queries' rows, recomputed by hand in the layer's forward
  hook (projection, RoPE, repeated keys, an fp32 softmax of a (B, H, window, S) tensor);
* TOVAPress: the same recomputation for the last row.

The presses here are subclasses of those three that override only `score`, so they keep kvpress's
pruning and hooks, and kvpress's wrapper presses take them as any ScorerPress (AdaKVPress is
tested):

* FusedObservedAttentionPress: the column sums of P, normalised by each key's visible queries and
  averaged over each GQA group (attention_stats' col_sum="group_mean", visible_normalized=True),
  taken from the layer's own attention call in one fused pass when the model runs sdpa_math's
  attention ("exact_attention"): inside `with press(model):` a statistics collector
  (integrations.collect) replaces that attention for the prefill, returns O and the column sums
  and no weights. With another attention implementation ("sdpa", or inside a wrapper press whose
  own hooks run) the scores come from a second pass: the layer's queries recomputed from the
  hidden states as kvpress recomputes SnapKV's window, then attention_stats. Either way no
  (B, H, L, S) map is formed: eager attention is not needed.
* FusedSnapKVPress: the window's queries (kvpress's own get_prerope_query_states and
  transformers' rotate_half), then the column sums of their rows of P over all keys in one fused
  pass (GQA groups read by the kernel without repeating the keys, then averaged:
  col_sum="group_mean"). On "exact_attention" the window's rows come from the layer's own
  attention call instead (the collector's rows=slice(-window_size, None)), nothing recomputed.
* FusedTOVAPress: the same for the last query, averaged over all heads.

Scores are float32 (float64 for float64 models) however the model is stored; kvpress's own are
in the model's dtype. The scale is the module's `scaling` (1/sqrt(head_dim) for Llama, what kvpress
uses). Like kvpress's presses these assume the prefill of unpadded sequences (L = S, causal).

    import sdpa_math.integrations.transformers          # registers "exact_attention"
    from sdpa_math.integrations.kvpress import FusedObservedAttentionPress
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="exact_attention")
    press = FusedObservedAttentionPress(compression_ratio=0.5)
    with torch.no_grad(), press(model):
        model(input_ids, past_key_values=DynamicCache())

Needs kvpress (and the transformers it pins, <5.3): this module imports it; the rest of
sdpa_math does not. docs/kvpress.md.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from kvpress import ObservedAttentionPress, SnapKVPress, TOVAPress
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from ..stats import attention_stats
from . import collect as _collect
from . import transformers as _hf

__all__ = ["FusedObservedAttentionPress", "FusedSnapKVPress", "FusedTOVAPress", "window_queries",
           "window_column_sums"]


def window_queries(module: torch.nn.Module, hidden_states: torch.Tensor, n: int,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The last n queries of the layer, (B, H, n, head_dim), rotated: kvpress's projection
    (get_prerope_query_states: q_proj, Phi-3's fused qkv_proj, Qwen3/Gemma3's q_norm) and the
    rotary embedding as transformers' Llama applies it (q cos + rotate_half(q) sin), on the
    hook's position embeddings."""
    q = get_prerope_query_states(module, hidden_states[:, -n:])
    cos, sin = position_embeddings
    cos, sin = cos[:, -n:].unsqueeze(1), sin[:, -n:].unsqueeze(1)
    return q * cos + rotate_half(q) * sin


def _scale(module: torch.nn.Module) -> float:
    return getattr(module, "scaling", None) or module.head_dim ** -0.5


def window_column_sums(module: torch.nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, n: int, position_embeddings, *, visible_normalized: bool = False
                       ) -> torch.Tensor:
    """(B, Hkv, S) in float32: Σ over the last n queries of P[h, i, j], averaged over each GQA
    group's query heads (col_sum="group_mean"), the queries at the last n of the S positions
    (a query sees the keys up to its own position). n = S is the whole causal map, and with
    visible_normalized each key's sum is divided by the number of queries that see it (H2O).
    One fused pass (attention_stats); no (B, H, n, S) map is formed. O is computed and dropped:
    attention_stats has no statistics-only mode."""
    S = keys.shape[-2]
    q = window_queries(module, hidden_states, n, position_embeddings)
    gqa = q.shape[1] != keys.shape[1]
    if n == S:  # the whole prefill: top-left causal is the model's mask
        mask, causal = None, True
    else:  # query i of the window sits at position S - n + i and sees keys j <= S - n + i
        pos = torch.arange(S - n, S, device=keys.device)
        mask, causal = torch.arange(S, device=keys.device)[None, :] <= pos[:, None], False
    _, stats = attention_stats(q, keys, values, mask, 0.0, causal, scale=_scale(module), enable_gqa=gqa,
                               col_sum="group_mean", visible_normalized=visible_normalized)
    return stats["col_sum"]


class _FromLayerStats:
    """Mixin: inside `with press(model):`, on a model whose attention is sdpa_math's
    ("exact_attention" or "sdpa_math"), a statistics collector (integrations.collect) replaces the
    layers' attention calls: each returns O and the statistics of _layer_stats() from one fused
    pass, and no weights, so no layer forms its map. `_stats(module)` hands `score` the layer's
    statistics of this prefill (None without a collector: the press then takes its second pass)."""

    def _layer_stats(self) -> dict:
        raise NotImplementedError

    def _stats(self, module, keys):
        rec = self.__dict__.get("_recorder")
        stats = rec.stats.pop(module.layer_idx, None) if rec is not None else None
        # the latest call of this layer, and one over all its keys (the prefill's)
        if stats is None or next(iter(stats.values())).shape[-1] != keys.shape[-2]:
            return None
        return stats

    @contextmanager
    def __call__(self, model):
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl not in _hf.NAMES or self.compression_ratio == 0:
            with super().__call__(model):
                yield
            return
        with _collect.collect(model, **self._layer_stats()) as rec:
            self.__dict__["_recorder"] = rec
            try:
                with super().__call__(model):
                    yield
            finally:
                self.__dict__.pop("_recorder", None)


@dataclass
class FusedObservedAttentionPress(_FromLayerStats, ObservedAttentionPress):
    """ObservedAttentionPress (H2O) without eager attention: the score of key j for KV head g is
    the mean over g's query heads of Σ_i P[h, i, j] / (L - j), kvpress's definition, as
    attention_stats' column sums (col_sum="group_mean", visible_normalized=True).

    With the model on attn_implementation="exact_attention" (or "sdpa_math") the sums come from
    the layer's own attention call (a collector is active inside `with press(model):`); with any
    other implementation, or when a wrapper press calls `score` under its own hooks, from a second
    pass over the layer's recomputed queries (window_column_sums with n = L)."""

    compression_ratio: float = 0.0

    def _layer_stats(self):
        return {"col_sum": "group_mean", "visible_normalized": True}

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        stats = self._stats(module, keys)
        if stats is not None:
            return stats["col_sum"]
        return window_column_sums(module, hidden_states, keys, values, hidden_states.shape[1],
                                  kwargs["position_embeddings"], visible_normalized=True)


def _window_rows_mean(rows: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, n, S) rows of P (the collector's `rows`) -> (B, Hkv, S) float32: the mean over
    the rows, summed in float32, then over each GQA group's query heads."""
    B, H, n, S = rows.shape
    stat = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return rows.sum(-2, dtype=stat).div_(n).view(B, kv_heads, H // kv_heads, S).mean(2)


@dataclass
class FusedSnapKVPress(_FromLayerStats, SnapKVPress):
    """SnapKVPress with the window's attention from sdpa_math: the mean over the last
    window_size queries of P[h, i, j] (keys before the window), averaged over each GQA group,
    then kvpress's smoothing (avg_pool1d over kernel_size keys) and the window kept.

    On "sdpa" (any implementation but sdpa_math's): the window's queries recomputed and their
    column sums in one fused pass (window_column_sums; a (B, Hkv, S) result, the keys not
    repeated). On "exact_attention": the window's rows of P from the layer's own attention call
    (the collector's rows=slice(-window_size, None), in the model's dtype), nothing recomputed;
    attention_stats has no column sums over chosen rows, so those rows, (B, H, window, S), are
    held for the moment the score takes, as kvpress's own window is."""

    compression_ratio: float = 0.0
    window_size: int = 64
    kernel_size: int = 5

    def _layer_stats(self):
        return {"rows": slice(-self.window_size, None)}

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        w = self.window_size
        assert hidden_states.shape[1] > w, \
            f"Query length {hidden_states.shape[1]} should be greater than the window size {w}"
        stats = self._stats(module, keys)
        if stats is not None:
            means = _window_rows_mean(stats["rows"], keys.shape[1])
        else:
            means = window_column_sums(module, hidden_states, keys, values, w, kwargs["position_embeddings"]) / w
        # pooling and the group mean are linear per key column, so their order is free
        scores = F.avg_pool1d(means[..., :-w], kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
        return F.pad(scores, (0, w), value=scores.max().item() + 1)  # the window itself is always kept


@dataclass
class FusedTOVAPress(_FromLayerStats, TOVAPress):
    """TOVAPress with the last query's row of P from sdpa_math (recomputed query and the fused
    statistics on "sdpa"; the layer's own call's last row on "exact_attention"), averaged over all
    query heads (the group means averaged over the KV heads): the same score for every KV head,
    the last key always kept."""

    compression_ratio: float = 0.0

    def _layer_stats(self):
        return {"rows": slice(-1, None)}

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        stats = self._stats(module, keys)
        if stats is not None:
            row = _window_rows_mean(stats["rows"], keys.shape[1])
        else:
            row = window_column_sums(module, hidden_states, keys, values, 1, kwargs["position_embeddings"])
        scores = row[..., :-1].mean(1, keepdim=True).repeat(1, keys.shape[1], 1)
        return F.pad(scores, (0, 1), value=scores.max().item() + 1)
