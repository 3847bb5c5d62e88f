"""Hugging Face transformers: exact attention that returns its weights, for every model that uses
transformers' attention interface.

    import sdpa_math.integrations.transformers    # registers "exact_attention" (and "sdpa_math")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="exact_attention")
    out = model(ids, output_attentions=True)      # out.attentions: one (B, Hq, L, S) map per layer

The attention function is registered with transformers' AttentionInterface, and the mask function
(the boolean masks transformers builds for SDPA, sliding windows included) with
AttentionMaskInterface, under two names:

* "exact_attention" (NAME): the name to use. transformers does not special-case it, so every model
  whose attention goes through the interface accepts it, including models that refuse SDPA
  (GPT-OSS and the other attention-sink models: transformers treats any name containing "sdpa" as
  SDPA and checks the model's _supports_sdpa).
* "sdpa_math" (ALIASES): the original name, kept. It works wherever "sdpa" does.

Keywords the models pass (docs/huggingface.md has the table): attention sinks (s_aux) and a
position bias (position_bias, T5 and its family) are honoured exactly through the operator's float
mask, their gradients included; sliding windows arrive in the mask; logit soft-capping (softcap,
Gemma 2) cannot be expressed through an additive mask and raises ValueError. A keyword that is
neither honoured nor known to leave the scores alone (IGNORED) raises ValueError naming it rather
than being dropped.

One difference from eager: a query row whose keys are all masked (a left-padding position of a
causal model) gets a zero row of weights and a zero output, the operator's contract and PyTorch
SDPA's, where eager's finite mask gives a uniform row. Every other row, and everything the
unpadded positions compute, equals eager's.

maps_for_layers(model, layers) keeps the maps for chosen layers only and runs
torch.nn.functional.scaled_dot_product_attention elsewhere (those layers return None weights).
"""
from __future__ import annotations

import re

import torch

from ..api import attention

NAME = "exact_attention"
ALIASES = ("sdpa_math",)
NAMES = (NAME,) + ALIASES

# Keywords that describe nothing about the scores of this call: output flags, cache bookkeeping,
# positions (already applied to q and k), and the flash kernels' packing descriptors (mask-based
# implementations see packed sequences through the mask, which transformers builds from
# position_ids; see _check_packing). Extend this set for a keyword you have checked.
IGNORED = {
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "use_cache",
    "cache_position", "past_key_values", "past_key_value", "position_ids", "num_items_in_batch",
    "encoder_hidden_states", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
    "max_length_k", "seq_idx", "deterministic", "layer_idx",
}
# Keywords that change the scores in a way an additive mask cannot express.
REFUSED = {
    "softcap": "logit soft-capping (scores -> softcap*tanh(scores/softcap)) cannot be expressed as an "
               "additive mask; set the config's attn_logit_softcapping=None (for Gemma 2) or use "
               "attn_implementation=\"eager\"",
}

_MAPS_ATTR = "_sdpa_math_maps"  # per attention module: True (maps), False (fast path), or an error string


def _float_mask(attention_mask, query):
    """The mask as an additive float mask in the query's dtype (None stays None); masked entries
    are -inf, so that a fully masked row stays all zeros as with a bool mask."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return attention_mask if attention_mask is None else attention_mask.to(query.dtype)
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(attention_mask, zero, float("-inf"))


def _causal_mask(query, kv_length):
    """The upper-left causal mask that is_causal=True means, as bool (1, 1, L, S)."""
    L = query.shape[2]
    rows = torch.arange(L, device=query.device)[:, None]
    return (rows >= torch.arange(kv_length, device=query.device)[None, :]).view(1, 1, L, kv_length)


def _check_keywords(module, kwargs):
    for name, value in kwargs.items():
        if value is None or name in IGNORED:
            continue
        if name in REFUSED:
            raise ValueError(f"{NAME} attention ({type(module).__name__}): {name}={value!r} is not supported: "
                             f"{REFUSED[name]}")
        raise ValueError(f"{NAME} attention ({type(module).__name__}) got the keyword {name}=..., which it does "
                         f"not implement; ignoring it could change the result. Use attn_implementation=\"eager\", "
                         f"or, if {name} does not affect the attention scores, add it to "
                         f"sdpa_math.integrations.transformers.IGNORED")


def _check_packing(attention_mask, kwargs):
    cu = kwargs.get("cu_seq_lens_q")
    if attention_mask is None and cu is not None and cu.numel() > 2:
        raise ValueError(f"{NAME} attention: packed sequences (cu_seq_lens_q with {cu.numel() - 1} sequences) but "
                         "no attention mask; pass position_ids to the model so that transformers builds the "
                         "block-diagonal mask, or use a flash attention implementation")


def _maps_wanted(module):
    state = module.__dict__.get(_MAPS_ATTR, True)
    if isinstance(state, str):
        raise ValueError(state)
    return state


def operator_inputs(module, query, key, value, attention_mask, dropout, is_causal, sliding_window, s_aux,
                    position_bias, kwargs):
    """The operator's arguments from transformers' attention call: (key, value, mask, dropout,
    is_causal, enable_gqa). Checks the keywords and the packing, trims the mask to the keys, and
    folds a position bias and attention sinks into one float mask (a sink is one more key with
    zero key and value vectors, so the caller drops the last column of P). Shared by
    exact_attention_forward and the statistics collector."""
    _check_keywords(module, kwargs)
    _check_packing(attention_mask, kwargs)
    B, Hq, L = query.shape[:3]
    S = key.shape[-2]
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :S]
    # Causal with no mask is how transformers asks for plain causal attention (the mask
    # function skips building it); one query row attends to everything before it anyway.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and L > 1)
    if sliding_window is not None and attention_mask is None and S > sliding_window:
        # transformers' mask functions build the window into the mask once S reaches it; a missing
        # mask here would mean the window is not applied.
        raise ValueError(f"{NAME} attention: sliding_window={sliding_window} with {S} keys needs the sliding-window "
                         "mask, and none was given")

    if position_bias is not None or s_aux is not None:
        # Everything goes into one float mask: the bias, the (causal) mask, the sink column.
        if causal:
            attention_mask, causal = _causal_mask(query, S), False
        attention_mask = _float_mask(attention_mask, query)
        if position_bias is not None:
            position_bias = position_bias[..., :S].to(query.dtype)
            attention_mask = position_bias if attention_mask is None else attention_mask + position_bias
        if s_aux is not None:
            # Softmax over [scores, sink]: one more key whose key and value vectors are zero (score
            # 0 * scale + sink, no contribution to the output); its column of P is dropped.
            if s_aux.numel() != Hq:
                raise ValueError(f"{NAME} attention: s_aux has {s_aux.numel()} entries, expected one per query "
                                 f"head ({Hq})")
            mask = torch.zeros((), dtype=query.dtype, device=query.device) if attention_mask is None else attention_mask
            mask = mask.expand(B, Hq, L, S)
            sink = s_aux.to(query.dtype).reshape(1, Hq, 1, 1).expand(B, Hq, L, 1)
            attention_mask = torch.cat([mask, sink], dim=-1)
            key = torch.cat([key, key.new_zeros(*key.shape[:-2], 1, key.shape[-1])], dim=-2)
            value = torch.cat([value, value.new_zeros(*value.shape[:-2], 1, value.shape[-1])], dim=-2)

    dropout = dropout if module.training else 0.0
    return key, value, attention_mask, dropout, causal, Hq != key.shape[1]


def exact_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                            sliding_window=None, s_aux=None, position_bias=None, **kwargs):
    """transformers' attention-function signature.

    query (B, Hq, L, D), key/value (B, Hkv, S, D) not repeated for GQA, attention_mask a bool
    (B, 1, L, S) mask (True = attend), a float additive mask, or None. s_aux (Hq,): one sink logit
    per head; position_bias (1 or B, Hq, L, S), added to the scores (after scaling). Returns the
    output as (B, L, Hq, D), contiguous, and the weights P as (B, Hq, L, S), or None in a layer that
    maps_for_layers left out. Raises ValueError for softcap and for unknown keywords (see IGNORED)."""
    S = key.shape[-2]
    key, value, attention_mask, dropout, causal, gqa = operator_inputs(
        module, query, key, value, attention_mask, dropout, is_causal, sliding_window, s_aux, position_bias, kwargs)
    if _maps_wanted(module):
        output, probs = attention(query, key, value, attention_mask, dropout, causal, scale=scaling, enable_gqa=gqa)
        if s_aux is not None:
            probs = probs[..., :S]
    else:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
            enable_gqa=gqa)
        probs = None
    return output.transpose(1, 2).contiguous(), probs


# The original name of the function.
sdpa_math_attention_forward = exact_attention_forward


def _layer_number(name, module):
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        return idx
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)
    return int(numbers[-1]) if numbers else None


class maps_for_layers:
    """Maps for the chosen layers only; torch.nn.functional.scaled_dot_product_attention elsewhere.

        with maps_for_layers(model, {0, 3}):
            out = model(ids, output_attentions=True)   # out.attentions: layer 0's and layer 3's maps
        maps_for_layers(model, {0, 3})                 # or without `with`: until
        maps_for_layers(model, None)                   # maps in every layer again

    layers: layer numbers and/or modules. A number selects every attention module whose layer
    number matches: module.layer_idx where transformers sets it, else the last index in the
    module's path (model.layers.3.self_attn -> 3; in an encoder-decoder both stacks' layer 3).
    A module selects every attention module inside it (model.model.decoder.layers[1], or one
    attention module). A number that matches nothing, or a module outside the model, raises
    ValueError; so does calling a layer whose number cannot be told when numbers were given.

    layers=() keeps no maps at all. The choice is stored on the model's modules, so it applies to
    every call of the model (gradient checkpointing's recomputation included), and is undone on
    leaving the `with` block. It only matters where the model runs this module's attention
    function (attn_implementation "exact_attention" or "sdpa_math"). Layers left out
    return None weights, which transformers' output capture skips: out.attentions then holds only
    the chosen layers' maps, in order. Outputs and gradients are the same either way (up to
    rounding: the fast path sums in a different order)."""

    def __init__(self, model: torch.nn.Module, layers):
        self._saved = {m: m.__dict__.get(_MAPS_ATTR, _MISSING) for m in model.modules()}
        if layers is None:
            for m in model.modules():
                m.__dict__.pop(_MAPS_ATTR, None)
            return
        if isinstance(layers, (int, torch.nn.Module)):
            layers = [layers]
        layers = list(layers)
        numbers = {x for x in layers if isinstance(x, int) and not isinstance(x, bool)}
        chosen = [x for x in layers if isinstance(x, torch.nn.Module)]
        if len(numbers) + len(chosen) != len(layers):
            raise TypeError("maps_for_layers: layers must be ints (layer numbers) or torch.nn.Module objects")
        inside = set()
        for c in chosen:
            if c not in self._saved:
                raise ValueError(f"maps_for_layers: the {type(c).__name__} given is not a module of this model")
            inside.update(c.modules())
        states, seen = {}, set()
        for name, m in model.named_modules():
            number = _layer_number(name, m)
            seen.add(number)
            if m in inside:
                states[m] = True
            elif number is None and numbers:
                states[m] = (f"maps_for_layers: cannot tell the layer number of {name or 'the model'} "
                             f"({type(m).__name__}); select it by passing the module")
            else:
                states[m] = number in numbers
        missing = numbers - seen
        if missing:
            raise ValueError(f"maps_for_layers: no layer numbered {sorted(missing)} in this model")
        for m, state in states.items():
            m.__dict__[_MAPS_ATTR] = state

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for m, state in self._saved.items():
            if state is _MISSING:
                m.__dict__.pop(_MAPS_ATTR, None)
            else:
                m.__dict__[_MAPS_ATTR] = state
        return False


_MISSING = object()


def register() -> None:
    """Registers NAME and ALIASES with transformers (done on import; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name in NAMES:
        AttentionInterface.register(name, exact_attention_forward)
        AttentionMaskInterface.register(name, sdpa_mask)


register()
