"""Hugging Face transformers: attention that returns its weights at fused-kernel speed.

    import sdpa_math.integrations.transformers  # registers "sdpa_math"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa_math")
    out = model(ids, output_attentions=True)      # out.attentions: one (B, Hq, L, S) map per layer

The attention function is registered with transformers' AttentionInterface and its mask
function (the boolean masks transformers builds for SDPA) with AttentionMaskInterface, both under
the name "sdpa_math". Attention weights equal eager attention's; without output_attentions the
model's outputs are the same and the maps are simply not kept.
"""
from __future__ import annotations

from ..api import attention

NAME = "sdpa_math"

# Keywords some models pass that change the scores in ways the operator does not implement:
# Gemma 2's logit soft-capping, GPT-OSS's attention sinks, T5's relative position bias. Ignoring
# them would return maps that differ from eager's without a word, so a call with one of them set
# is refused; such models run with attn_implementation="eager".
UNSUPPORTED = {"softcap": "logit soft-capping", "s_aux": "attention sinks", "position_bias": "a position bias"}


def sdpa_math_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                is_causal=None, **kwargs):
    """transformers' attention-function signature.

    query (B, Hq, L, D), key/value (B, Hkv, S, D) not repeated for GQA, attention_mask a bool
    (B, 1, L, S) mask (True = attend), a float additive mask, or None. Returns the output as
    (B, L, Hq, D), contiguous, and the weights P as (B, Hq, L, S). Raises ValueError for a keyword
    of UNSUPPORTED that is set."""
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"sdpa_math attention does not implement {what} ({name}=...): its maps would "
                             f"differ from eager attention's; load this model with attn_implementation=\"eager\"")
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    # Causal with no mask is how transformers asks for plain causal attention (the mask
    # function skips building it); one query row attends to everything before it anyway.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and attention_mask is None and query.shape[2] > 1)
    output, probs = attention(query, key, value, attention_mask, dropout if module.training else 0.0, causal,
                              scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2).contiguous(), probs


def register() -> None:
    """Registers "sdpa_math" with transformers (done on import; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_math_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
