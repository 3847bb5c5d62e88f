"""sdpa_math.integrations.collect: per-layer statistics of a Hugging Face model's attention maps
during an ordinary forward, against the same quantities computed from eager attention's maps
(output_attentions=True) of a copy with the same weights. CPU, tiny random Llama with GQA
(8 query heads, 2 key heads), float32, no downloads.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import sdpa_math.integrations.transformers as hf  # noqa: E402  (registers "exact_attention")
from sdpa_math.integrations import collect as col  # noqa: E402

ATOL = 2e-5
H, HKV, LAYERS, L = 8, 2, 2, 17


def _cfg():
    return transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                    num_attention_heads=H, num_key_value_heads=HKV, head_dim=8,
                                    max_position_embeddings=64, initializer_range=0.2, attention_dropout=0.0)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    build = transformers.AutoModelForCausalLM.from_config
    eager = build(copy.deepcopy(_cfg()), attn_implementation="eager").eval()
    ours = build(copy.deepcopy(_cfg()), attn_implementation=hf.NAME).eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(0, 512, (2, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: query rows 0..4 of sequence 1 see no key (fully masked)
    return ids, mask


def _eager_maps(eager, ids, mask):
    """Eager's maps with the fully masked (padding) query rows set to 0, the value our operator
    gives them (eager's finite mask makes them uniform)."""
    with torch.no_grad():
        maps = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    pad = (mask == 0)[:, None, :, None]
    return [p.masked_fill(pad, 0) for p in maps]


def test_logits_unchanged_inside_the_collector(models, batch):
    eager, ours = models
    ids, mask = batch
    with torch.no_grad():
        outside = ours(input_ids=ids, attention_mask=mask).logits
        with col.collect(ours, col_sum="per_head", row_entropy=True, chunk_rows=5) as rec:
            inside = ours(input_ids=ids, attention_mask=mask).logits
        reference = eager(input_ids=ids, attention_mask=mask).logits
    assert sorted(rec.stats) == list(range(LAYERS))
    keep = mask.bool()
    torch.testing.assert_close(inside[keep], outside[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inside[keep], reference[keep], rtol=1e-4, atol=ATOL)
    # Leaving the block restores transformers' entries and stops recording.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert all(ALL_ATTENTION_FUNCTIONS[n] is hf.exact_attention_forward for n in hf.NAMES)
    before = rec.stats[0]["col_sum"]
    with torch.no_grad():
        ours(input_ids=ids[:, :5])
    assert rec.stats[0]["col_sum"] is before
    assert not any(col._ATTR in m.__dict__ for m in ours.modules())


@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_row_entropy_and_col_sum_match_eager_maps(models, batch, chunk_rows):
    eager, ours = models
    ids, mask = batch
    maps = _eager_maps(eager, ids, mask)
    with torch.no_grad(), col.collect(ours, col_sum="per_head", row_entropy=True, chunk_rows=chunk_rows) as rec:
        ours(input_ids=ids, attention_mask=mask)
    pad = mask == 0
    for layer, p in enumerate(maps):
        st = rec.stats[layer]
        assert st["col_sum"].shape == (2, H, L) and st["row_entropy"].shape == (2, H, L)
        torch.testing.assert_close(st["col_sum"], p.sum(-2), rtol=1e-4, atol=ATOL)
        ent = -torch.xlogy(p, p).sum(-1)
        keep = (~pad)[:, None, :].expand(2, H, L)
        torch.testing.assert_close(st["row_entropy"][keep], ent[keep], rtol=1e-4, atol=ATOL)
        # Padding rows (fully masked): P = 0, so entropy 0 (docs/statistics.md), and padding keys get no mass.
        assert (st["row_entropy"][~keep] == 0).all()
        assert (st["col_sum"][pad[:, None, :].expand(2, H, L)] == 0).all()
        # Non-trivial: entropies differ between heads and are not those of a uniform row.
        assert st["row_entropy"][0, :, -1].std() > 1e-3


def _topk(score, k):
    """Top-k key sets per leading index, and the smallest gap between the k-th and (k+1)-th score."""
    s = score.sort(dim=-1, descending=True)
    return set(map(tuple, s.indices[..., :k].sort(-1).values.flatten(0, -2).tolist())), \
        (s.values[..., k - 1] - s.values[..., k]).min().item()


def test_h2o_and_snapkv_rankings_match_eager(models):
    """H2O: a key's score is its column sum of P over all query rows, summed over the query heads
    that read its key head (col_sum="group_sum": one ranking per KV head and sequence). SnapKV: the
    keys before an observation window of the last w query rows, scored by their column sum over
    the window rows, summed over the group's query heads (taken from rows=slice(-w, None); SnapKV's
    1-d pooling acts on this score afterwards and is left out)."""
    eager, ours = models
    ids = torch.randint(0, 512, (2, L), generator=torch.Generator().manual_seed(2))
    w, k = 4, 5
    with torch.no_grad():
        maps = eager(input_ids=ids, output_attentions=True).attentions
        with col.collect(ours, col_sum="group_sum", rows=slice(-w, None)) as rec:
            ours(input_ids=ids)
    for layer, p in enumerate(maps):
        st = rec.stats[layer]
        h2o_e = p.unflatten(1, (HKV, H // HKV)).sum((2, 3))  # (B, Hkv, S)
        snap_e = p[..., -w:, :L - w].unflatten(1, (HKV, H // HKV)).sum((2, 3))
        h2o_o = st["col_sum"]
        assert h2o_o.shape == (2, HKV, L) and st["rows"].shape == (2, H, w, L)
        snap_o = st["rows"][..., :L - w].unflatten(1, (HKV, H // HKV)).sum((2, 3))
        for ours_score, eager_score in ((h2o_o, h2o_e), (snap_o, snap_e)):
            want, gap = _topk(eager_score, k)
            got, _ = _topk(ours_score, k)
            assert gap > 1e-3, "k-th and (k+1)-th scores too close for a stable ranking; change the seed"
            assert got == want
            torch.testing.assert_close(ours_score, eager_score, rtol=1e-4, atol=ATOL)
        # group_sum totals: G query heads per key head, each row sums to 1.
        torch.testing.assert_close(h2o_o.sum(-1), torch.full((2, HKV), float(L * H // HKV)))
        # The two rankings are different questions: they disagree somewhere in this model.
        assert not torch.equal(h2o_e[..., :L - w].argsort(-1), snap_e.argsort(-1))


def test_refusals(models):
    eager, ours = models
    with pytest.raises(ValueError, match="attention implementation"):
        col.collect(eager, row_entropy=True)
    with pytest.raises(TypeError, match="unknown"):
        col.collect(ours, kl_to=None)
    with pytest.raises(ValueError, match="at least one"):
        col.collect(ours)
    with col.collect(ours, row_entropy=True):
        with pytest.raises(ValueError, match="already active"):
            col.collect(ours, row_entropy=True).__enter__()


def test_chosen_heads_of_chosen_layers_only(models, batch):
    """heads={layer: [...]}: only that layer is collected, only its chosen heads' rows and entropy,
    equal to eager's maps of those heads; the model's logits are unchanged."""
    eager, ours = models
    ids, mask = batch
    maps = _eager_maps(eager, ids, mask)
    chosen = [5, 2]
    with torch.no_grad(), col.collect(ours, heads={1: chosen}, rows=slice(-3, None), row_entropy=True) as rec:
        logits = ours(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        outside = ours(input_ids=ids, attention_mask=mask).logits
    assert set(rec.stats) == {1}
    want = maps[1][:, chosen]
    torch.testing.assert_close(rec.stats[1]["rows"], want[:, :, -3:], atol=ATOL, rtol=0)
    ent = -(want * want.clamp_min(1e-30).log()).sum(-1)
    torch.testing.assert_close(rec.stats[1]["row_entropy"], ent, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, outside, atol=1e-5, rtol=1e-5)  # padded rows too: O follows the contract


def test_per_layer_keywords_name_layers_the_model_has(models):
    with pytest.raises(ValueError, match="heads names layers \\[7\\]"):
        with col.collect(models[1], heads={7: [0]}, row_entropy=True):
            pass
