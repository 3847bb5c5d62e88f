"""sdpa_math as a Hugging Face transformers attention implementation ("sdpa_math"), against
eager attention on models built from small configs with random weights (no downloads): a
Llama-style decoder with GQA, a BERT-style encoder, and a Whisper-style encoder-decoder whose
cross-attention maps drive word timestamps. Attentions, logits and a training step's gradients
must match eager's. Runs on the GPU when there is one (larger sizes), else on the CPU.
"""
import pytest
import torch

import sdpa_math.integrations.transformers  # noqa: F401  (registers "sdpa_math")

transformers = pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BIG = DEVICE == "cuda"
# fp32 everywhere: both sides compute the softmax in fp32; the products differ in summation order.
ATOL = 2e-5


def _pair(build, cfg):
    """The same random weights under eager and under sdpa_math."""
    torch.manual_seed(0)
    eager = build(cfg, attn_implementation="eager").to(DEVICE)
    ours = build(cfg, attn_implementation="sdpa_math").to(DEVICE)
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "sdpa_math"
    return eager, ours


def _compare(eager, ours, inputs, attention_keys, loss_of):
    out_e = eager(**inputs, output_attentions=True)
    out_o = ours(**inputs, output_attentions=True)
    for key in attention_keys:
        maps_e, maps_o = getattr(out_e, key), getattr(out_o, key)
        assert maps_o is not None and len(maps_o) == len(maps_e), key
        for a, b in zip(maps_o, maps_e):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=ATOL)
    logits = "logits" if hasattr(out_e, "logits") else "last_hidden_state"
    torch.testing.assert_close(getattr(out_o, logits), getattr(out_e, logits), rtol=1e-4, atol=1e-4)
    # Without output_attentions: plain outputs, the same.
    plain = ours(**inputs)
    torch.testing.assert_close(getattr(plain, logits), getattr(out_e, logits), rtol=1e-4, atol=1e-4)
    # A training step's gradients, through an attention-entropy term too.
    grads = []
    for model in (eager, ours):
        model.train()
        model.zero_grad()
        out = model(**inputs, output_attentions=True)
        maps = getattr(out, attention_keys[0])
        entropy = sum(-(m * (m + 1e-9).log()).sum(-1).mean() for m in maps)
        (loss_of(out) + 0.1 * entropy).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        model.eval()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-3, atol=1e-4, msg=name)


def test_llama_style_decoder_with_gqa_and_padding():
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256 if BIG else 64, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                   head_dim=32 if BIG else 8, max_position_embeddings=256, initializer_range=0.2,
                                   attention_dropout=0.0)
    eager, ours = _pair(transformers.AutoModelForCausalLM.from_config, cfg)
    L = 96 if BIG else 17
    ids = torch.randint(0, 1024, (2, L), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: fully masked query rows in the second sequence
    inputs = dict(input_ids=ids, attention_mask=mask)
    _compare(eager, ours, inputs, ["attentions"],
             lambda out: torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    # Greedy generation with a KV cache: decode steps attend one query row to the cache.
    gen_e = eager.generate(ids[:1], max_new_tokens=6, do_sample=False)
    gen_o = ours.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(gen_e, gen_o)


def test_bert_style_encoder_with_key_padding():
    cfg = transformers.BertConfig(vocab_size=1024, hidden_size=128 if BIG else 64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=256,
                                  initializer_range=0.2, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    eager, ours = _pair(transformers.AutoModel.from_config, cfg)
    L = 80 if BIG else 19
    ids = torch.randint(0, 1024, (3, L), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    mask[2, -9:] = 0
    _compare(eager, ours, dict(input_ids=ids, attention_mask=mask), ["attentions"],
             lambda out: out.last_hidden_state.pow(2).mean())


def test_whisper_style_encoder_decoder_cross_attention():
    cfg = transformers.WhisperConfig(vocab_size=1024, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_source_positions=32, max_target_positions=64,
                                     init_std=0.2, dropout=0.0, attention_dropout=0.0, pad_token_id=0,
                                     decoder_start_token_id=1, eos_token_id=2, bos_token_id=1)
    eager, ours = _pair(transformers.WhisperForConditionalGeneration._from_config, cfg)
    gen = torch.Generator(DEVICE).manual_seed(3)
    feats = torch.randn(2, 16, 64, device=DEVICE, generator=gen)
    dec = torch.randint(3, 1024, (2, 9), device=DEVICE, generator=gen)
    _compare(eager, ours, dict(input_features=feats, decoder_input_ids=dec),
             ["cross_attentions", "encoder_attentions", "decoder_attentions"],
             lambda out: torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), dec[:, 1:].flatten()))


@pytest.mark.parametrize("name", ["softcap", "s_aux", "position_bias"])
def test_score_changing_keywords_are_refused_not_ignored(name):
    """Gemma 2's softcap, GPT-OSS's sinks, T5's position bias: ignoring them gave maps that differ
    from eager's without an error; now the call names the keyword. Unset (None), they are fine."""
    from sdpa_math.integrations.transformers import sdpa_math_attention_forward

    module = torch.nn.Module()
    module.is_causal = False
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    with pytest.raises(ValueError, match=f"{name}=.*attn_implementation=\"eager\""):
        sdpa_math_attention_forward(module, q, k, v, None, **{name: torch.ones(1)})
    out, probs = sdpa_math_attention_forward(module, q, k, v, None, **{name: None})
    assert out.shape == (1, 5, 2, 8) and probs.shape == (1, 2, 5, 5)
