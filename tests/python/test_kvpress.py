"""sdpa_math.integrations.kvpress: kvpress's H2O (observed attention), SnapKV and TOVA presses with
their scores from sdpa_math's fused statistics, against kvpress's own presses on eager attention.

Needs kvpress 0.5.5 and the transformers it pins (<5.3): the environment of
scripts/setup_kvpress_env.sh. Elsewhere (the main test environment, transformers 5.17) every test
but the import check is skipped with the reason. CPU, tiny random Llama made here (no downloads),
float32.

What is compared, per press, compression ratio and GQA or not:
* the kept key positions of every layer's pruned cache, ours against kvpress's on eager attention
  (each kept key row found among the layer's unpruned keys, bit for bit);
* the scores, ours against kvpress's, within RTOL (below);
* ours runs on "sdpa" or sdpa_math's "exact_attention", never "eager"; the attention modules
  return no weights; and no op of the prefill makes a tensor as large as a (B, H, L, S) map
  (kvpress's eager route does, the positive control).
"""
import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _skip_reason():
    if importlib.util.find_spec("kvpress") is None:
        return "kvpress is not installed: run these tests in the environment of scripts/setup_kvpress_env.sh"
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) >= (5, 3):
        return (f"kvpress 0.5.5 needs transformers<5.3 (its hook reads kwargs['past_key_values']); this is "
                f"{transformers.__version__}: use scripts/setup_kvpress_env.sh")
    return None


SKIP = _skip_reason()
needs_kvpress = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

# Scores, ours against kvpress's on eager attention (float32 model): layer 0's inputs are the same
# bits, later layers' differ by the two attention implementations' rounding (about 1e-7 relative);
# a score is a sum of at most L = 96 probabilities, rounded in float32 on kvpress's side (its
# softmax, its sums and divisions) and summed in float64 on ours. Measured: at most 6e-6 relative
# (the smallest scores, around 1e-5, in layer 1), while the reference's scores at the cut of
# every case are at least 1e-3 relative apart: RTOL leaves 3x margin and is 50x below the gaps.
RTOL, ATOL = 2e-5, 1e-8
L, B, LAYERS, HEADS = 96, 2, 2, 4
WINDOW = 8  # SnapKV's window (kvpress's default 64 needs more than 64 tokens of prefill; 96 would do, 8 tests more keys)


def test_sdpa_math_imports_without_kvpress():
    code = "import sys, sdpa_math, sdpa_math.stats, sdpa_math.integrations.collect; " \
           "assert 'kvpress' not in sys.modules, 'sdpa_math imported kvpress'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def _model(kv_heads, impl):
    import transformers
    import sdpa_math.integrations.transformers  # noqa: F401  (registers "exact_attention")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=16,
                                   max_position_embeddings=4096, initializer_range=0.2, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation(impl)
    return model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (B, L), generator=torch.Generator().manual_seed(1))


class _Largest(TorchDispatchMode):
    """The largest number of elements of any tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _prefill(model, ids, press=None, largest=False):
    """(cache, scores per layer, weights returned per layer, largest op output) of one prefill."""
    from transformers import DynamicCache
    scores, weights, hooks = [], [], []
    if press is not None:
        score = press.score
        press.score = lambda *a: scores.append(score(*a)) or scores[-1]
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(lambda m, i, o: weights.append(o[1])))
    cache, mode = DynamicCache(), _Largest()
    try:
        with torch.no_grad(), press(model) if press is not None else torch.no_grad():
            if largest:
                with mode:
                    model(ids, past_key_values=cache)
            else:
                model(ids, past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
        if press is not None:
            del press.score  # the instance attribute: the class's method again
    return cache, scores, weights, mode.numel


def _kept_positions(cache, full):
    """Per layer, (B, Hkv, n_kept) sorted positions of the pruned cache's keys among the unpruned
    keys of the same model (bit-for-bit row matches; each kept row matches exactly one position)."""
    out = []
    for layer, ref in zip(cache.layers, full.layers):
        same = (layer.keys[:, :, :, None, :] == ref.keys[:, :, None, :, :]).all(-1)  # (B, Hkv, n, S)
        assert (same.sum(-1) == 1).all(), "a kept key matches no position, or several"
        out.append(same.float().argmax(-1).sort(-1).values)
    return out


def _presses(kind, ratio):
    import kvpress
    from sdpa_math.integrations import kvpress as ours
    if kind == "h2o":
        return kvpress.ObservedAttentionPress(ratio), ours.FusedObservedAttentionPress(ratio)
    if kind == "snapkv":
        return (kvpress.SnapKVPress(ratio, window_size=WINDOW, kernel_size=5),
                ours.FusedSnapKVPress(ratio, window_size=WINDOW, kernel_size=5))
    return kvpress.TOVAPress(ratio), ours.FusedTOVAPress(ratio)


_reference_cache = {}


def _reference(kind, ratio, kv_heads, ids):
    """kvpress's own press on eager attention: kept positions and scores (cached per case)."""
    key = (kind, ratio, kv_heads)
    if key not in _reference_cache:
        model = _model(kv_heads, "eager")
        full, *_ = _prefill(model, ids)
        cache, scores, weights, numel = _prefill(model, ids, _presses(kind, ratio)[0], largest=(kind == "h2o"))
        _reference_cache[key] = (_kept_positions(cache, full), scores, numel)
    return _reference_cache[key]


def _unpadded(kind, s):
    """The scores kvpress ranks freely: SnapKV and TOVA pad the kept window with max + 1."""
    return s[..., :-WINDOW] if kind == "snapkv" else s[..., :-1] if kind == "tova" else s


CASES = [(kind, ratio, kv, impl)
         for kind, impls in (("h2o", ("exact_attention", "sdpa")), ("snapkv", ("sdpa", "exact_attention")),
                             ("tova", ("sdpa", "exact_attention")))
         for ratio in (0.25, 0.5, 0.75) for kv in (2, 4) for impl in impls
         if impl == impls[0] or ratio == 0.5]


@needs_kvpress
@pytest.mark.parametrize("kind,ratio,kv_heads,impl", CASES,
                         ids=[f"{k}-r{r}-{'gqa' if kv < HEADS else 'mha'}-{i}" for k, r, kv, i in CASES])
def test_same_kept_keys_as_kvpress_on_eager(kind, ratio, kv_heads, impl, ids):
    from kvpress.utils import compute_n_kept
    ref_kept, ref_scores, ref_numel = _reference(kind, ratio, kv_heads, ids)
    model = _model(kv_heads, impl)
    assert model.config._attn_implementation == impl != "eager"
    full, *_ = _prefill(model, ids)
    press = _presses(kind, ratio)[1]
    cache, scores, weights, numel = _prefill(model, ids, press, largest=True)

    n_kept = compute_n_kept(L, ratio)
    assert len(scores) == LAYERS and all(layer.keys.shape == (B, kv_heads, n_kept, 16) for layer in cache.layers)
    for layer, (a, b) in enumerate(zip(scores, ref_scores)):
        assert a.shape == b.shape == (B, kv_heads, L)
        a, b = _unpadded(kind, a), _unpadded(kind, b)
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"layer {layer}: {m}")
        # the comparison of kept keys below means something only where the reference's n_kept-th
        # and next score are further apart than the scores' tolerance
        if n_kept < a.shape[-1]:
            top = b.topk(n_kept + 1, dim=-1).values
            gap = top[..., -2] - top[..., -1]
            assert (gap > RTOL * top[..., -2] + ATOL).all(), f"layer {layer}: a near-tie at the cut, pick another seed"
    for layer, (a, b) in enumerate(zip(_kept_positions(cache, full), ref_kept)):
        assert torch.equal(a, b), f"layer {layer}: kept key positions differ"

    # no map: the attention modules return no weights, and no op made a (B, H, L, S)-sized tensor
    assert weights and all(w is None for w in weights)
    assert numel < B * HEADS * L * L, f"an op returned a tensor of {numel} elements, a whole map's worth"
    if kind == "h2o":  # the positive control: kvpress's route holds the eager map
        assert ref_numel >= B * HEADS * L * L


@needs_kvpress
@pytest.mark.parametrize("kind", ["h2o", "snapkv", "tova"])
def test_on_exact_attention_scores_come_from_the_layers_own_attention(kind, ids, monkeypatch):
    """On "exact_attention" the scores come from the layer's own attention call (the collector:
    H2O's column sums, SnapKV's and TOVA's window rows), not from a second pass over recomputed
    queries; after the press the layers are sdpa_math's attention again (weights returned)."""
    from sdpa_math.integrations import kvpress as ours

    def second_pass(*a, **k):
        raise AssertionError("the press recomputed the queries")

    monkeypatch.setattr(ours, "window_column_sums", second_pass)
    model = _model(2, "exact_attention")
    cache, scores, weights, _ = _prefill(model, ids, _presses(kind, 0.5)[1])
    assert len(scores) == LAYERS and cache.layers[0].keys.shape[2] == L // 2
    assert all(w is None for w in weights)
    _, _, weights, _ = _prefill(model, ids)
    assert all(w is not None and w.shape == (B, HEADS, L, L) for w in weights)


def _masked(model):
    """AdaKVPress's pruned (batch, head, position) triples of every layer, as sorted flat indices."""
    out = []
    for layer in model.model.layers:
        b, h, s = layer.self_attn.masked_key_indices
        out.append(((b * HEADS + h) * L + s).sort().values)
    return out


@needs_kvpress
@pytest.mark.parametrize("kind", ["h2o", "snapkv"])
def test_wrapper_press_takes_ours_on_sdpa(kind, ids):
    """The presses are kvpress ScorerPresses, so kvpress's wrappers take them. AdaKVPress (head-wise
    budgets from `score`, called under the wrapper's own hooks) refuses eager attention, so kvpress
    cannot run it with the observed-attention press at all; with ours it runs on "sdpa" (the H2O
    scores from the second pass). Reference: AdaKVPress replaying kvpress's own scores from eager
    attention (SnapKV: also kvpress's own SnapKVPress on sdpa)."""
    from dataclasses import dataclass
    import kvpress
    from transformers import DynamicCache

    @dataclass
    class Replay(kvpress.ScorerPress):
        recorded: tuple = ()

        def score(self, module, *args):
            return self.recorded[module.layer_idx].clone()  # AdaKVPress writes into the scores

    _, ref_scores, _ = _reference(kind, 0.5, 2, ids)
    presses = [Replay(0.5, recorded=tuple(ref_scores)), _presses(kind, 0.5)[1]]
    if kind == "snapkv":
        presses.append(_presses(kind, 0.5)[0])
    masked = []
    for press in presses:
        model = _model(2, "sdpa")
        with torch.no_grad(), kvpress.AdaKVPress(press)(model):
            model(ids, past_key_values=DynamicCache())
        masked.append(_masked(model))
    for other in masked[1:]:
        for layer, (a, b) in enumerate(zip(masked[0], other)):
            assert torch.equal(a, b), f"layer {layer}: AdaKVPress pruned other keys"
