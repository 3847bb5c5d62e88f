"""Per-layer statistics of the attention maps of a Hugging Face model, maps never materialised
(issue 16): a collector around an ordinary forward.

    import sdpa_math.integrations.collect as collect
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="exact_attention")
    with collect.collect(model, col_sum="group_sum", row_entropy=True, rows=slice(-4, None)) as rec:
        model(ids)
    rec.stats[0]["col_sum"]      # layer 0: (B, Hkv, S), see docs/statistics.md

How: for the duration of the `with` block the collector puts a recorder on every module of the
model (module.__dict__, as maps_for_layers does) and overrides transformers' ALL_ATTENTION_FUNCTIONS
entries "exact_attention" and "sdpa_math" (a local override of that one instance, which modeling
files read on every call) with collect_attention_forward. That function runs attention_stats for
modules that carry a recorder and hands every other call, of any other model, to the function
the entry held before, unchanged. On leaving the last active collector the entries are restored.
The model's config is not touched; it must already use "exact_attention" (or "sdpa_math").

Mask, causal, GQA, attention sinks (s_aux) and position bias are handled as in
exact_attention_forward, with its helpers. The attention output is attention_stats' O (the
operator's O); the weights returned are None (out.attentions skips them).
"""
from __future__ import annotations

import torch

from .._ops import ops
from ..api import attention
from ..stats import attention_stats
from ..stats.logits import _tracked
from . import transformers as hf

__all__ = ["collect", "Recorder", "collect_attention_forward", "STAT_KEYWORDS"]

STAT_KEYWORDS = ("col_sum", "visible_normalized", "row_entropy", "head_mean", "rows", "heads", "chunk_rows")
PER_LAYER = ("rows", "heads")  # keywords that may also be {layer number: value}
_ATTR = "_sdpa_math_collect"  # per module: the Recorder collecting for it
_active = 0                   # collectors inside their `with` block
_saved = {}                   # name -> the local-mapping entry before the first collector (or _MISSING)
_MISSING = object()


class Recorder:
    """What a collector gathered. stats[layer] is the dict attention_stats returned for that
    attention module in the latest call (a later forward in the same block replaces it), keyed
    by module.layer_idx (else the last number in the module's path, else the path).
    by_name[path] holds the same dicts keyed by module path ("model.layers.0.self_attn"); use it
    when two attention modules share a layer index (an encoder-decoder), where stats raises."""

    def __init__(self, options):
        self.options = options
        self.stats: dict = {}
        self.by_name: dict[str, dict[str, torch.Tensor]] = {}
        self._owner: dict = {}
        self._names: dict = {}

    def _key(self, module):
        name = self._names.get(module, type(module).__name__)
        key = hf._layer_number(name, module)
        return name, (name if key is None else key)

    def options_for(self, module):
        """attention_stats' keywords for this module's layer, or None where a per-layer keyword
        ({layer: value}) leaves its layer out: that layer is not collected."""
        _, key = self._key(module)
        opts = {}
        for k, v in self.options.items():
            if k in PER_LAYER and isinstance(v, dict):
                if key not in v:
                    return None
                v = v[key]
            opts[k] = v
        return opts

    def _record(self, module, stats):
        name, key = self._key(module)
        owner = self._owner.setdefault(key, name)
        if owner != name:
            raise ValueError(f"collect: attention modules {owner} and {name} both have layer number {key}; "
                             "read Recorder.by_name instead of Recorder.stats")
        self.stats[key] = stats
        self.by_name[name] = stats


def collect_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                              sliding_window=None, s_aux=None, position_bias=None, *, _fallback=None, **kwargs):
    """transformers' attention-function signature (as exact_attention_forward). For a module with
    a recorder: O from attention_stats, the statistics stored in the recorder, weights None.
    Any other module: _fallback (the entry the collector replaced) answers."""
    rec = module.__dict__.get(_ATTR)
    options = rec.options_for(module) if rec is not None else None
    if options is None:
        fallback = _fallback or hf.exact_attention_forward
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, sliding_window=sliding_window, s_aux=s_aux, position_bias=position_bias,
                        **kwargs)
    S = key.shape[-2]
    if s_aux is not None and options.get("row_entropy"):
        raise ValueError("collect: row_entropy with attention sinks (s_aux) is not supported: the sink takes part "
                         "of each row's mass, so the entropy of the key columns alone is not a row entropy")
    key, value, mask, dropout, causal, gqa = hf.operator_inputs(
        module, query, key, value, attention_mask, dropout, is_causal, sliding_window, s_aux, position_bias, kwargs)
    out, stats = attention_stats(query, key, value, mask, dropout, causal, scale=scaling, enable_gqa=gqa, **options)
    if options.get("heads") is not None:
        out = _every_heads_output(query, key, value, mask, causal, scaling, gqa)
    if s_aux is not None:  # drop the sink's column, as exact_attention_forward drops it from P
        stats = {k: (v[..., :S] if k in ("col_sum", "rows", "head_mean") else v) for k, v in stats.items()}
    rec._record(module, stats)
    return out.transpose(1, 2).contiguous(), None


def _every_heads_output(query, key, value, mask, causal, scale, gqa):
    """The layer's O of every head where the statistics were of chosen heads: the fused statistics
    operator with nothing asked (O without forming P) where it runs without a gradient, else the
    operator itself. Both follow the contract (a fully masked row's O is 0, where PyTorch's own
    attention gives NaN or the mean of V)."""
    if not _tracked(query, key, value, mask) and (query.device.type == "cpu" or ops.forward_stats_has_kernel(
            query, key, value, mask, causal, scale, gqa, False, False, 0)):
        return ops.forward_stats(query, key, value, mask, causal, scale, gqa, False, False, 0, 0, 1)[0]
    return attention(query, key, value, mask, 0.0, causal, scale=scale, enable_gqa=gqa)[0]


def _install():
    global _active
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns
    if _active == 0:
        for name in hf.NAMES:
            _saved[name] = fns._local_mapping.get(name, _MISSING)
            previous = fns[name]

            def forward(*args, _previous=previous, **kwargs):
                return collect_attention_forward(*args, _fallback=_previous, **kwargs)

            fns[name] = forward
    _active += 1


def _uninstall():
    global _active
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns
    _active -= 1
    if _active == 0:
        for name, entry in _saved.items():
            if entry is _MISSING:
                fns._local_mapping.pop(name, None)
            else:
                fns._local_mapping[name] = entry
        _saved.clear()


class collect:
    """with collect(model, **stats) as rec: model(...)  ->  rec.stats[layer] (see Recorder).

    stats: attention_stats' statistic keywords: col_sum, visible_normalized, row_entropy,
    head_mean, rows, heads, chunk_rows (docs/statistics.md). rows and heads may also be given per
    layer, as {layer number: value}: then only the layers named there are collected (the others
    run the model's attention as before), e.g. heads={3: [1, 5], 4: [0]} for alignment heads. model.config._attn_implementation must be
    "exact_attention" or "sdpa_math" (ValueError otherwise). Dropout must be off (model.eval(), or
    attention_dropout=0): attention_stats raises for dropout. row_entropy with attention sinks
    raises. Not reentrant on the same model (ValueError)."""

    def __init__(self, model: torch.nn.Module, **stats):
        unknown = set(stats) - set(STAT_KEYWORDS)
        if unknown:
            raise TypeError(f"collect: unknown keywords {sorted(unknown)}; accepted: {STAT_KEYWORDS}")
        if not stats or not any(stats.get(k) for k in ("col_sum", "row_entropy", "head_mean")) \
                and stats.get("rows") is None:
            raise ValueError("collect: ask for at least one statistic (col_sum, row_entropy, head_mean or rows)")
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if impl not in hf.NAMES:
            raise ValueError(f"collect: the model's attention implementation is {impl!r}; build it with "
                             f"attn_implementation={hf.NAME!r} (or call model.set_attn_implementation({hf.NAME!r}))")
        self.model = model
        self.recorder = Recorder(dict(stats))

    def __enter__(self) -> Recorder:
        modules = dict(self.model.named_modules())
        if any(_ATTR in m.__dict__ for m in modules.values()):
            raise ValueError("collect: a collector is already active on this model")
        self.recorder._names = {m: name for name, m in modules.items()}
        numbers = {hf._layer_number(name, m) for name, m in modules.items()}
        for k in PER_LAYER:
            per_layer = self.recorder.options.get(k)
            if isinstance(per_layer, dict) and set(per_layer) - numbers:
                raise ValueError(f"collect: {k} names layers {sorted(set(per_layer) - numbers, key=str)} that this "
                                 "model does not have")
        for m in modules.values():
            m.__dict__[_ATTR] = self.recorder
        _install()
        return self.recorder

    def __exit__(self, *exc):
        for m in self.model.modules():
            if m.__dict__.get(_ATTR) is self.recorder:
                del m.__dict__[_ATTR]
        _uninstall()
        return False
