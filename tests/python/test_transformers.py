"""sdpa_math as a Hugging Face transformers attention implementation ("exact_attention", alias
"sdpa_math"), against eager attention on models built from small configs with random weights (no
downloads): Llama (GQA, padding), Gemma 2 (sliding window), GPT-OSS (attention sinks), BERT, T5
(learned relative position bias), Whisper (encoder self- and decoder cross-attention), ViT and
CLIP. Attentions, logits and a training step's gradients must match eager's; the keywords the
operator cannot honour must raise; maps_for_layers keeps maps for chosen layers only. Runs on the
GPU when there is one (larger sizes), else on the CPU.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sdpa_math.integrations.transformers as hf  # noqa: E402  (registers "exact_attention" and "sdpa_math")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BIG = DEVICE == "cuda"
# fp32 everywhere: both sides compute the softmax in fp32; the products differ in summation order.
ATOL = 2e-5


def _gen(seed):
    return torch.Generator(DEVICE).manual_seed(seed)


def _pair(build, cfg, name=hf.NAME):
    """The same random weights under eager and under ours. Each model gets its own copy of the
    config: from_config keeps the object it is given and sets the implementation on it, so with a
    shared config the "eager" model would run ours too."""
    torch.manual_seed(0)
    eager = build(copy.deepcopy(cfg), attn_implementation="eager").to(DEVICE)
    ours = build(copy.deepcopy(cfg), attn_implementation=name).to(DEVICE)
    ours.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager" and ours.config._attn_implementation == name
    for sub in ("text_config", "vision_config", "encoder", "decoder"):
        if hasattr(eager.config, sub) and hasattr(getattr(eager.config, sub), "_attn_implementation"):
            assert getattr(eager.config, sub)._attn_implementation == "eager"
            assert getattr(ours.config, sub)._attn_implementation == name
    return eager, ours


def _get(out, path):
    for part in path.split("."):
        out = getattr(out, part)
    return out


def _assert_maps(maps_o, maps_e, key, masked_rows=None):
    assert maps_o is not None and len(maps_o) == len(maps_e) > 0, key
    for a, b in zip(maps_o, maps_e):
        assert a.shape == b.shape, key
        if masked_rows is not None:
            # Fully masked query rows: zero in ours (the operator's contract, and PyTorch SDPA's);
            # eager's finite mask makes them uniform. Neither is used by anything downstream.
            assert (a[masked_rows[:, None, :].expand(a.shape[:3])] == 0).all(), key
            a, b = (m.masked_fill(masked_rows[:, None, :, None], 0) for m in (a, b))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=ATOL, msg=key)


def _compare(eager, ours, inputs, attention_keys, loss_of, output="logits", must_have_grads=(), masked_rows=None):
    """Maps, outputs, and a training step's gradients (through an attention-entropy term too) of
    ours equal eager's. masked_rows (B, L): query positions whose rows are fully masked (left
    padding in a causal model), left out of the comparison of maps and outputs and of the
    entropy term; loss_of must leave them out too. Returns eager's outputs (with maps)."""
    keep = None if masked_rows is None else ~masked_rows
    out_e = eager(**inputs, output_attentions=True)
    out_o = ours(**inputs, output_attentions=True)
    for key in attention_keys:
        _assert_maps(_get(out_o, key), _get(out_e, key), key, masked_rows)

    def close_outputs(a, b):
        if keep is not None:
            a, b = a[keep], b[keep]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    close_outputs(_get(out_o, output), _get(out_e, output))
    # Without output_attentions: plain outputs, the same.
    close_outputs(_get(ours(**inputs), output), _get(out_e, output))
    grads = []
    for model in (eager, ours):
        model.train()
        model.zero_grad()
        out = model(**inputs, output_attentions=True)
        entropy = 0
        for m in _get(out, attention_keys[0]):
            rows = -(m * (m + 1e-9).log()).sum(-1)
            entropy = entropy + (rows.mean() if keep is None else rows.masked_select(keep[:, None, :]).mean())
        (loss_of(out) + 0.1 * entropy).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        model.eval()
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-3, atol=1e-4, msg=name)
    for fragment in must_have_grads:
        hits = [n for n in grads[0] if fragment in n]
        assert hits, fragment
        assert all(grads[0][n].abs().sum() > 0 for n in hits), fragment
    return out_e


def _ce(logits, labels, mask=None):
    """Next-token cross entropy; predictions from or of positions where mask is 0 are ignored."""
    labels = labels[:, 1:]
    if mask is not None:
        labels = labels.masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())


def _llama_cfg(layers=2):
    return transformers.LlamaConfig(vocab_size=1024, hidden_size=256 if BIG else 64, intermediate_size=256,
                                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=32 if BIG else 8, max_position_embeddings=256, initializer_range=0.2,
                                    attention_dropout=0.0)


@pytest.mark.parametrize("name", [hf.NAME, "sdpa_math"])
def test_llama_style_decoder_with_gqa_and_padding(name):
    eager, ours = _pair(transformers.AutoModelForCausalLM.from_config, _llama_cfg(), name)
    L = 96 if BIG else 17
    ids = torch.randint(0, 1024, (2, L), device=DEVICE, generator=_gen(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: fully masked query rows in the second sequence
    inputs = dict(input_ids=ids, attention_mask=mask)
    _compare(eager, ours, inputs, ["attentions"], lambda out: _ce(out.logits, ids, mask), masked_rows=mask == 0)
    # Greedy generation with a KV cache: decode steps attend one query row to the cache.
    gen_e = eager.generate(ids[:1], max_new_tokens=6, do_sample=False)
    gen_o = ours.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(gen_e, gen_o)


def _gemma2_cfg(softcap):
    return transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                     query_pre_attn_scalar=16, attn_logit_softcapping=softcap,
                                     max_position_embeddings=64, initializer_range=0.2, attention_dropout=0.0)


def test_gemma2_sliding_window_without_softcap():
    cfg = _gemma2_cfg(None)
    assert cfg.layer_types[0] == "sliding_attention" and cfg.layer_types[1] == "full_attention"
    eager, ours = _pair(transformers.AutoModelForCausalLM.from_config, cfg)
    ids = torch.randint(0, 256, (2, 12), device=DEVICE, generator=_gen(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = _compare(eager, ours, dict(input_ids=ids, attention_mask=mask), ["attentions"],
                   lambda out: _ce(out.logits, ids, mask), masked_rows=mask == 0)
    # The window is really in play: in the sliding layer a query sees only its last 4 keys.
    far = torch.ones(12, 12, dtype=torch.bool, device=DEVICE).tril(-4)
    assert out.attentions[0][..., far].abs().max() == 0
    assert out.attentions[1][0][..., far].abs().max() > 0


def test_gemma2_softcap_is_refused_by_name():
    cfg = _gemma2_cfg(50.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=hf.NAME).to(DEVICE)
    ids = torch.randint(0, 256, (1, 6), device=DEVICE, generator=_gen(5))
    with pytest.raises(ValueError, match=r"softcap=50\.0.*attn_logit_softcapping=None"):
        model(input_ids=ids)


def test_gpt_oss_attention_sinks():
    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                    num_local_experts=4, num_experts_per_tok=2, initializer_range=0.5,
                                    max_position_embeddings=64, attention_dropout=0.0)
    assert cfg.layer_types[0] == "sliding_attention"
    # transformers refuses any name containing "sdpa" for a model without SDPA support.
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa_math")
    eager, ours = _pair(transformers.AutoModelForCausalLM.from_config, cfg)
    sinks = [m.sinks for m in ours.modules() if hasattr(m, "sinks")]
    assert len(sinks) == 2 and all(s.abs().min() > 0 for s in sinks)
    ids = torch.randint(0, 256, (2, 10), device=DEVICE, generator=_gen(6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    # Left padding: fully masked rows are sink-only, zero in both.
    out = _compare(eager, ours, dict(input_ids=ids, attention_mask=mask), ["attentions"],
                   lambda out: _ce(out.logits, ids), must_have_grads=["sinks"])
    # The sink takes mass: rows of the maps sum to less than one.
    assert (out.attentions[1].sum(-1) < 0.999).any()
    # The fast path of maps_for_layers honours the sinks too.
    with hf.maps_for_layers(ours, {1}):
        fast = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
    _assert_maps(fast.attentions, out.attentions[1:], "attentions")
    torch.testing.assert_close(fast.logits, out.logits, rtol=1e-4, atol=1e-4)


def test_bert_style_encoder_with_key_padding():
    cfg = transformers.BertConfig(vocab_size=1024, hidden_size=128 if BIG else 64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=256,
                                  initializer_range=0.2, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    eager, ours = _pair(transformers.AutoModel.from_config, cfg)
    L = 80 if BIG else 19
    ids = torch.randint(0, 1024, (3, L), device=DEVICE, generator=_gen(2))
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    mask[2, -9:] = 0
    _compare(eager, ours, dict(input_ids=ids, attention_mask=mask), ["attentions"],
             lambda out: out.last_hidden_state.pow(2).mean(), output="last_hidden_state")


def test_t5_learned_position_bias():
    cfg = transformers.T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    eager, ours = _pair(transformers.T5ForConditionalGeneration._from_config, cfg)
    with torch.no_grad():  # a bias that matters (its random init is small)
        for model in (eager, ours):
            for name, p in model.named_parameters():
                if "relative_attention_bias" in name:
                    p.mul_(4)
    ids = torch.randint(1, 256, (2, 11), device=DEVICE, generator=_gen(7))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    dec = torch.randint(1, 256, (2, 7), device=DEVICE, generator=_gen(8))
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    out = _compare(eager, ours, inputs, ["encoder_attentions", "decoder_attentions", "cross_attentions"],
                   lambda out: _ce(out.logits, dec), must_have_grads=["relative_attention_bias"])
    # The fast path of maps_for_layers honours the bias too (layer 0 computes it, layer 1 reuses it).
    with hf.maps_for_layers(ours, {1}):
        fast = ours(**inputs, output_attentions=True)
    for key in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        _assert_maps(getattr(fast, key), getattr(out, key)[1:], key)
    torch.testing.assert_close(fast.logits, out.logits, rtol=1e-4, atol=1e-4)
    gen_e = eager.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    gen_o = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(gen_e, gen_o)


def _whisper_cfg():
    return transformers.WhisperConfig(vocab_size=1024, num_mel_bins=16, d_model=64, encoder_layers=2,
                                      decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                      encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
                                      max_target_positions=64, init_std=0.2, dropout=0.0, attention_dropout=0.0,
                                      pad_token_id=0, decoder_start_token_id=1, eos_token_id=2, bos_token_id=1)


def _whisper_inputs():
    gen = _gen(3)
    feats = torch.randn(2, 16, 64, device=DEVICE, generator=gen)
    dec = torch.randint(3, 1024, (2, 9), device=DEVICE, generator=gen)
    return dict(input_features=feats, decoder_input_ids=dec)


def test_whisper_style_encoder_decoder_cross_attention():
    eager, ours = _pair(transformers.WhisperForConditionalGeneration._from_config, _whisper_cfg())
    inputs = _whisper_inputs()
    _compare(eager, ours, inputs, ["cross_attentions", "encoder_attentions", "decoder_attentions"],
             lambda out: _ce(out.logits, inputs["decoder_input_ids"]))


def test_vit():
    cfg = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=4, num_labels=3, initializer_range=0.2,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    eager, ours = _pair(transformers.ViTForImageClassification._from_config, cfg)
    pixels = torch.randn(2, 3, 16, 16, device=DEVICE, generator=_gen(9))
    labels = torch.tensor([0, 2], device=DEVICE)
    _compare(eager, ours, dict(pixel_values=pixels), ["attentions"],
             lambda out: torch.nn.functional.cross_entropy(out.logits, labels))


def test_clip_text_and_vision():
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=16, initializer_range=0.2,
                         attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4, initializer_range=0.2, attention_dropout=0.0),
        projection_dim=16)
    eager, ours = _pair(transformers.CLIPModel._from_config, cfg)
    ids = torch.randint(3, 256, (2, 9), device=DEVICE, generator=_gen(10))
    ids[:, -1] = 2
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    pixels = torch.randn(2, 3, 16, 16, device=DEVICE, generator=_gen(11))
    _compare(eager, ours, dict(input_ids=ids, attention_mask=mask, pixel_values=pixels),
             ["text_model_output.attentions", "vision_model_output.attentions"],
             lambda out: out.logits_per_image.log_softmax(-1).diagonal().sum(), output="logits_per_image")


# The attention function on its own, against the formulas of transformers' eager functions (fp64).

def _qkv(B=2, Hq=4, Hkv=2, L=5, S=7, D=8, seed=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, dtype=torch.float64, generator=g).requires_grad_()
            for h, n in ((Hq, L), (Hkv, S), (Hkv, S))]


def _module(causal=False, groups=2):
    module = torch.nn.Module()
    module.is_causal = causal
    module.num_key_value_groups = groups
    module.eval()
    return module


def _eager_scores(q, k, scale):
    return q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scale


def test_sinks_against_gpt_oss_formula_with_gradients():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    q, k, v = _qkv()
    keep = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(13)) > 0.3
    keep[..., 0] = True
    module = _module()
    module.sinks = torch.nn.Parameter(torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(14)))
    float_mask = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    results = []
    for fn, mask in ((gpt_oss_eager, float_mask), (hf.exact_attention_forward, keep)):
        out, probs = fn(module, q, k, v, mask, scaling=0.3, s_aux=module.sinks)
        (out.pow(2).sum() + probs.pow(3).sum()).backward()
        results.append([out, probs] + [t.grad.clone() for t in (q, k, v, module.sinks)])
        for t in (q, k, v, module.sinks):
            t.grad = None
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert results[0][-1].abs().min() > 0  # the sinks' gradient is not zero


def test_position_bias_against_t5_formula_with_gradients():
    from transformers.models.t5.modeling_t5 import eager_attention_forward as t5_eager

    q, k, v = _qkv(Hkv=4, L=6, S=6)
    bias = torch.randn(1, 4, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(15)).requires_grad_()
    for causal in (False, True):
        results = []
        for fn in (t5_eager, hf.exact_attention_forward):
            mask = None
            if fn is t5_eager and causal:
                mask = torch.zeros(6, 6, dtype=torch.float64).masked_fill(
                    ~torch.ones(6, 6, dtype=torch.bool).tril(), torch.finfo(torch.float64).min)
            out, probs = fn(_module(causal, groups=1), q, k, v, mask, scaling=1.0, position_bias=bias)
            (out.pow(2).sum() + probs.pow(3).sum()).backward()
            results.append([out, probs] + [t.grad.clone() for t in (q, k, v, bias)])
            for t in (q, k, v, bias):
                t.grad = None
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert (results[1][1][0, 0].triu(1) == 0).all() == causal


def test_keywords_not_honoured_raise_by_name():
    q, k, v = _qkv()
    module = _module()
    with pytest.raises(ValueError, match="softcap=30.0"):
        hf.exact_attention_forward(module, q, k, v, None, softcap=30.0)
    with pytest.raises(ValueError, match="indices=.*IGNORED"):
        hf.exact_attention_forward(module, q, k, v, None, indices=torch.zeros(1))
    with pytest.raises(ValueError, match="sliding_window=4"):
        hf.exact_attention_forward(module, q, k, v, None, sliding_window=4)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        hf.exact_attention_forward(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="one per query head"):
        hf.exact_attention_forward(module, q, k, v, None, s_aux=torch.zeros(2, dtype=torch.float64))
    # Unset (None) keywords and the ones known not to touch the scores are fine.
    out, probs = hf.exact_attention_forward(module, q, k, v, None, softcap=None, s_aux=None, position_bias=None,
                                            indices=None, output_attentions=True, position_ids=torch.arange(5),
                                            sliding_window=7)
    ref = _eager_scores(q, k, 8 ** -0.5).softmax(-1)
    torch.testing.assert_close(probs, ref)
    assert out.shape == (2, 5, 4, 8)


def test_maps_for_chosen_layers_only():
    cfg = _llama_cfg(layers=3)
    eager, ours = _pair(transformers.AutoModelForCausalLM.from_config, cfg)
    ids = torch.randint(0, 1024, (2, 9), device=DEVICE, generator=_gen(16))
    out_e = eager(input_ids=ids, output_attentions=True)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counting_sdpa
    try:
        with hf.maps_for_layers(ours, {0, 2}):
            out_o = ours(input_ids=ids, output_attentions=True)
        assert len(calls) == 1  # layer 1 took the fast path
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    # Layers left out return None weights, which transformers' output capture skips.
    _assert_maps(out_o.attentions, (out_e.attentions[0], out_e.attentions[2]), "attentions")
    torch.testing.assert_close(out_o.logits, out_e.logits, rtol=1e-4, atol=1e-4)
    # Outside the block: maps everywhere again.
    _assert_maps(ours(input_ids=ids, output_attentions=True).attentions, out_e.attentions, "attentions")
    # Without `with`, with a module: the choice stays until maps_for_layers(model, None). Training
    # with gradient checkpointing (forward recomputed in backward) gives eager's gradients.
    hf.maps_for_layers(ours, [ours.model.layers[1]])
    grads = []
    for model in (eager, ours):
        model.gradient_checkpointing_enable()
        model.train()
        out = model(input_ids=ids, output_attentions=True)
        assert len(out.attentions) == (3 if model is eager else 1)
        _ce(out.logits, ids).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.eval()
    torch.testing.assert_close(out.attentions[0], out_e.attentions[1], rtol=1e-4, atol=ATOL)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-3, atol=1e-4, msg=name)
    hf.maps_for_layers(ours, None)
    assert len(ours(input_ids=ids, output_attentions=True).attentions) == 3
    with pytest.raises(ValueError, match=r"no layer numbered \[5\]"):
        hf.maps_for_layers(ours, {0, 5})
    with pytest.raises(ValueError, match="not a module of this model"):
        hf.maps_for_layers(ours, [eager.model.layers[0]])
    assert len(ours(input_ids=ids, output_attentions=True).attentions) == 3  # the failed calls changed nothing


def test_maps_for_layers_unnumbered_module_and_no_maps():
    q, k, v = _qkv()
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_module()])
    model.extra = _module()
    with hf.maps_for_layers(model, {0}):
        assert hf.exact_attention_forward(model.blocks[0], q, k, v, None)[1] is not None
        with pytest.raises(ValueError, match="cannot tell the layer number of extra"):
            hf.exact_attention_forward(model.extra, q, k, v, None)
    with hf.maps_for_layers(model, [model.extra]):
        assert hf.exact_attention_forward(model.extra, q, k, v, None)[1] is not None
        assert hf.exact_attention_forward(model.blocks[0], q, k, v, None)[1] is None
    with hf.maps_for_layers(model, ()):
        out, probs = hf.exact_attention_forward(model.extra, q, k, v, None)
    assert probs is None
    torch.testing.assert_close(out, hf.exact_attention_forward(model.extra, q, k, v, None)[0])


def test_maps_for_layers_by_path_and_by_stack():
    """ViT's attention modules have no layer_idx: the number comes from the module path. In
    Whisper, a module selects one stack."""
    cfg = transformers.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=4, initializer_range=0.2)
    eager, ours = _pair(transformers.ViTModel._from_config, cfg)
    pixels = torch.randn(1, 3, 16, 16, device=DEVICE, generator=_gen(17))
    out_e = eager(pixel_values=pixels, output_attentions=True)
    with hf.maps_for_layers(ours, 1):
        _assert_maps(ours(pixel_values=pixels, output_attentions=True).attentions, out_e.attentions[1:], "vit")

    eager, ours = _pair(transformers.WhisperForConditionalGeneration._from_config, _whisper_cfg())
    inputs = _whisper_inputs()
    out_e = eager(**inputs, output_attentions=True)
    with hf.maps_for_layers(ours, [ours.model.decoder]):
        out_o = ours(**inputs, output_attentions=True)
    assert len(out_o.encoder_attentions) == 0
    _assert_maps(out_o.cross_attentions, out_e.cross_attentions, "cross_attentions")
    _assert_maps(out_o.decoder_attentions, out_e.decoder_attentions, "decoder_attentions")
    torch.testing.assert_close(out_o.logits, out_e.logits, rtol=1e-4, atol=1e-4)


def test_output_attentions_in_the_config_is_refused_by_transformers():
    """The per-call form model(..., output_attentions=True) is the one to use: transformers rejects
    config.output_attentions=True for any implementation but eager."""
    model = transformers.AutoModelForCausalLM.from_config(_llama_cfg(layers=1), attn_implementation=hf.NAME)
    with pytest.raises(ValueError, match="output_attentions"):
        model.config.output_attentions = True
