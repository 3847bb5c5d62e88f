"""The Hopper statistics kernel (forward_sm90.cu with STATS; issue 16) on an sm_90 GPU: that
attention_stats takes it where it should, that column sums and row entropy are within 1e-5
(relative) of float64 on the same rounded inputs, that O, lse and the rows window are the
forward's own, bit for bit, and what happens around it: NaN rows, fully masked rows, many heads
(several launches), repeated calls (no atomics: the same bits), and the inputs it declines.

Every output starts as NaN (SDPA_MATH_POISON_OUTPUTS=1): an element the kernel does not write
fails the comparison. Skipped without an sm_90 device.
"""
import math

import pytest
import torch

import sdpa_math
from cuda_helpers import (HALF_DTYPES, assert_stats_match_float64, cuda_kernels, dtype_id, make, make_mask, ref_stats,
                          reference, rel_err, sm90_only)
from sdpa_math.stats import attention_stats

pytestmark = sm90_only
ops = torch.ops.sdpa_math


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("SDPA_MATH_POISON_OUTPUTS", "1")


CASES = {  # B, Hq, Hkv, L, S, E, Ev, mask kind, causal, layout
    "d64": (2, 3, 3, 130, 200, 64, 64, "none", False, "contig"),
    "d128_causal_L_lt_S_blhe": (1, 2, 2, 257, 1100, 128, 128, "none", True, "blhe"),
    "causal_L_gt_S": (1, 2, 2, 300, 140, 64, 64, "none", True, "contig"),
    "d80_keypad": (2, 2, 2, 100, 300, 80, 80, "bool_keypad", False, "contig"),
    "gqa_bool_full_Ev96_blhe": (1, 4, 2, 190, 250, 128, 96, "bool_full", False, "blhe"),
    "float_full": (2, 2, 2, 150, 334, 128, 128, "float_full", False, "contig"),
    "float32_mask": (2, 2, 2, 150, 334, 64, 64, "float32_b1ls", False, "blhe"),
    "float_ls_d96": (1, 2, 2, 70, 130, 96, 128, "float_ls", False, "contig"),
    "odd_S_5_rows": (3, 2, 2, 5, 77, 64, 64, "none", False, "contig"),
}
# (Up to 4 query rows take the decode kernels instead: tests/python/test_cuda_decode_stats.py.)


def inputs(name, dtype, seed=0):
    B, Hq, Hkv, L, S, E, Ev, mask_kind, causal, layout = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed + L + S)
    q, k, v = make((B, Hq, L, E), dtype, layout, gen), make((B, Hkv, S, E), dtype, layout, gen), \
        make((B, Hkv, S, Ev), dtype, layout, gen)
    mask = make_mask(mask_kind, B, Hq, L, S, dtype, gen)
    return q, k, v, mask, dict(is_causal=causal, enable_gqa=Hq != Hkv)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", list(CASES))
def test_statistics_kernel_runs_and_is_within_1e_5_of_float64(name, dtype):
    q, k, v, mask, kw = inputs(name, dtype)
    S = k.shape[-2]
    win = slice(-3, None) if S % 2 == 0 else None  # P's rows take pair stores: an even S
    n_win = len(range(*win.indices(q.shape[-2]))) if win else 0
    assert ops.forward_stats_has_kernel(q, k, v, mask, kw["is_causal"], None, kw["enable_gqa"], True, True, n_win)
    (out, st), names = cuda_kernels(lambda: attention_stats(q, k, v, mask, col_sum="per_head", row_entropy=True,
                                                            rows=win, method="fused", **kw))
    assert any("forward_sm90" in n for n in names) and any("stats_columns" in n for n in names), names
    assert_stats_match_float64(st, q, k, v, mask, kw)
    O, P, lse = sdpa_math.attention_with_lse(q, k, v, mask, **kw)
    # with column sums every CTA runs the forward's two passes: its O, lse and P, bit for bit
    _, lse_stats, *_ = ops.forward_stats(q, k, v, mask, kw["is_causal"], None, kw["enable_gqa"], True, False, 0, 0, 1)
    assert torch.equal(out, O) and torch.equal(lse_stats, lse)
    if win is not None:
        assert torch.equal(st["rows"], P[..., win, :])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", ["d64", "d128_causal_L_lt_S_blhe", "causal_L_gt_S", "d80_keypad", "float_full",
                                  "float32_mask", "odd_S_5_rows"])
def test_one_pass_ctas_entropy_and_a_last_rows_window(name, dtype):
    """Without column sums, the CTAs with no row of the window run one pass over the keys (online
    max, O and the entropy's sum rescaled as it grows). Entropy within 1e-5 of float64; O and lse
    those of the forward to rounding (not bit for bit: another order of sums); the window's CTA
    runs the two passes, so its rows are P's bits."""
    q, k, v, mask, kw = inputs(name, dtype)
    S = k.shape[-2]
    win = slice(-2, None) if S % 2 == 0 else None
    (out, st), names = cuda_kernels(lambda: attention_stats(q, k, v, mask, row_entropy=True, rows=win, method="fused",
                                                            **kw))
    assert any("forward_sm90" in n for n in names) and not any("stats_columns" in n for n in names), names
    _, want_ent = ref_stats(q, k, v, mask, kw)
    assert rel_err(st["row_entropy"], want_ent) <= 1e-5, rel_err(st["row_entropy"], want_ent)
    torch.testing.assert_close(st["row_entropy"].double(), want_ent, rtol=1e-5, atol=1e-5)
    O, P, lse = sdpa_math.attention_with_lse(q, k, v, mask, **kw)
    torch.testing.assert_close(out, O, rtol=1e-2, atol=2e-3)
    _, lse_one, *_ = ops.forward_stats(q, k, v, mask, kw["is_causal"], None, kw["enable_gqa"], False, True, 0, 0, 1)
    torch.testing.assert_close(lse_one, lse, rtol=1e-5, atol=1e-5)
    if win is not None:
        assert torch.equal(st["rows"], P[..., win, :])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_one_pass_nan_and_fully_masked_rows(dtype):
    """The one-pass CTAs keep the contract's rows: a NaN score gives a NaN entropy, O row and lse;
    a row with no visible key entropy 0, O 0 and lse -inf."""
    q, k, v, _, kw = inputs("d64", dtype)
    q[0, 1, 7, 3] = float("nan")
    mask = torch.ones(q.shape[0], 1, q.shape[-2], k.shape[-2], dtype=torch.bool, device="cuda")
    mask[..., 20, :] = False
    out, lse, _, ent, _ = ops.forward_stats(q, k, v, mask, False, None, False, False, True, 0, 0, 1)
    assert torch.isnan(ent[0, 1, 7]) and torch.isnan(out[0, 1, 7]).all() and torch.isnan(lse[0, 1, 7])
    assert not torch.isnan(ent[0, 1, 6]) and not torch.isnan(ent[0, 0, 7])
    assert (ent[..., 20] == 0).all() and (out[..., 20, :] == 0).all() and (lse[..., 20] == float("-inf")).all()
    _, want_ent = ref_stats(q, k, v, mask, kw)  # (the reference gives the NaN row 0: left out)
    keep = torch.ones_like(want_ent, dtype=torch.bool)
    keep[0, 1, 7] = False
    torch.testing.assert_close(ent.double()[keep], want_ent[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask_dtype", ["float32", "same"])
def test_one_pass_entropy_after_a_left_padding_at_finfo_min(dtype, mask_dtype):
    """Hugging Face's padding: the first 200 keys of batch 0 held at finfo.min, so its rows' first
    128-key tile is wholly masked and the max then jumps by about FLT_MAX. The one-pass rescale
    of the entropy's sum must not make 0 · inf."""
    q, k, v, _, kw = inputs("float32_mask", dtype)
    mdt = torch.float32 if mask_dtype == "float32" else dtype
    mask = torch.zeros(q.shape[0], 1, q.shape[-2], k.shape[-2], dtype=mdt, device="cuda")
    mask[0, ..., :200] = torch.finfo(mdt).min
    (_, st), names = cuda_kernels(lambda: attention_stats(q, k, v, mask, row_entropy=True, method="fused", **kw))
    assert any("forward_sm90" in n for n in names), names
    _, want_ent = ref_stats(q, k, v, mask, kw)
    assert not torch.isnan(st["row_entropy"]).any()
    torch.testing.assert_close(st["row_entropy"].double(), want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_rows_window_of_a_causal_problem_is_P_there_hidden_keys_included(dtype):
    """Rows every 37th from 5 on a causal L < S problem: the keys right of a CTA's last tile are
    written as zeros by the kernel's tail, as the forward's P has them."""
    q, k, v, mask, kw = inputs("d128_causal_L_lt_S_blhe", dtype)
    _, P = sdpa_math.attention(q, k, v, mask, **kw)
    _, st = attention_stats(q, k, v, mask, rows=slice(5, None, 37), method="fused", **kw)
    assert torch.equal(st["rows"], P[..., 5::37, :])


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_nan_row_gives_nan_statistics(dtype):
    """A NaN score: the row's entropy is NaN, and its head's column sums are NaN at every key —
    those right of the row's causal tile too (a NaN row of P is NaN throughout)."""
    q, k, v, _, kw = inputs("d128_causal_L_lt_S_blhe", dtype)
    q = q.clone()
    q[0, 1, 20, 3] = float("nan")
    _, st = attention_stats(q, k, v, col_sum="per_head", row_entropy=True, method="fused", **kw)
    assert st["col_sum"][0, 1].isnan().all() and not st["col_sum"][0, 0].isnan().any()
    ent = st["row_entropy"]
    assert ent[0, 1, 20].isnan() and ent.isnan().sum() == 1


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_fully_masked_rows_have_entropy_0_and_add_nothing(dtype):
    q, k, v, mask, kw = inputs("gqa_bool_full_Ev96_blhe", dtype)  # row 5 of every head sees no key
    _, st = attention_stats(q, k, v, mask, col_sum="per_head", row_entropy=True, method="fused", **kw)
    assert (st["row_entropy"][..., 5] == 0).all()
    keep = torch.ones(q.shape[-2], dtype=torch.bool, device="cuda")
    keep[5] = False
    _, st2 = attention_stats(q[..., keep, :], k, v, mask[..., keep, :], col_sum="per_head", method="fused", **kw)
    torch.testing.assert_close(st["col_sum"], st2["col_sum"], rtol=1e-6, atol=1e-6)


def test_many_heads_take_several_launches_with_the_same_sums():
    """64 heads of 4096 x 4096: the column sums' partial rows would take more than 64 MiB, so the
    heads go in two launches. Against the fp32 chunks on the same rounded inputs, and the same bits
    on a second call."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(1, 64, 4096, 64, generator=gen, device="cuda").half() for _ in range(3))
    (_, a), names = cuda_kernels(lambda: attention_stats(q, k, v, col_sum="per_head", row_entropy=True, is_causal=True,
                                                         method="fused"))
    assert sum("stats_columns" in n for n in names) == 2, names  # 63 heads, then 1
    b = attention_stats(q, k, v, col_sum="per_head", row_entropy=True, is_causal=True, method="fused")[1]
    want = attention_stats(q.float(), k.float(), v.float(), col_sum="per_head", row_entropy=True, is_causal=True,
                           method="chunks")[1]
    for key in ("col_sum", "row_entropy"):
        assert torch.equal(a[key], b[key]), key
        assert rel_err(a[key], want[key].double()) <= 2e-5, key


def test_finfo_min_rows_of_a_bf16_mask_are_uniform():
    """Hugging Face's padding mask at bfloat16's min: a row held there entirely is uniform (entropy
    log S) and the statistics stay within 1e-5 of float64. (fp16's min, -65504, is not held to it:
    fp32 logits s - 65504 keep s to 2^-8, as in the forward's own P; docs/statistics.md.)"""
    q, k, v, _, kw = inputs("float_full", torch.bfloat16)
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = make_mask("float_b1ls", B, H, L, S, torch.bfloat16, torch.Generator(device="cuda").manual_seed(2))
    _, st = attention_stats(q, k, v, mask, col_sum="per_head", row_entropy=True, method="fused", **kw)
    want_cols, want_ent = ref_stats(q, k, v, mask, kw)
    torch.testing.assert_close(st["row_entropy"][..., 3].double(), torch.full((B, H), math.log(S), device="cuda",
                                                                               dtype=torch.float64))
    for key, want in (("col_sum", want_cols), ("row_entropy", want_ent)):
        assert rel_err(st[key], want) <= 1e-5, key


def test_group_and_visible_options_agree_with_the_chunks():
    q, k, v, mask, kw = inputs("gqa_bool_full_Ev96_blhe", torch.float16)
    for mode in ("per_head", "group_sum", "group_mean"):
        for vn in (False, True):
            a = attention_stats(q, k, v, mask, col_sum=mode, visible_normalized=vn, method="fused", **kw)[1]
            b = attention_stats(q.float(), k.float(), v.float(), mask, col_sum=mode, visible_normalized=vn,
                                method="chunks", **kw)[1]
            torch.testing.assert_close(a["col_sum"], b["col_sum"], rtol=2e-5, atol=1e-5)


def test_a_head_whose_column_sums_need_more_than_64_MiB_goes_to_the_chunks():
    """Launches split heads, not a head's rows: 32K x 32K keys would need 128 MiB of partial rows
    for one head, so the kernel declines the column sums there (entropy and rows it still takes)."""
    q, k, v = (torch.zeros(1, 1, 32768, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    assert not ops.forward_stats_has_kernel(q, k, v, None, True, None, False, True, True, 0)
    assert ops.forward_stats_has_kernel(q, k, v, None, True, None, False, False, True, 64)
    assert ops.forward_stats_has_kernel(q[..., :16384, :], k[..., :16384, :], v[..., :16384, :], None, True, None, False,
                                        True, True, 0)


def test_what_the_kernel_declines_goes_to_the_chunks_or_is_refused_by_name():
    gen = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen, device="cuda") for _ in range(3))  # fp32
    assert not ops.forward_stats_has_kernel(q, k, v, None, False, None, False, True, True, 0)
    _, st = attention_stats(q, k, v, col_sum="per_head", row_entropy=True)  # auto: the chunks
    want_cols, want_ent = ref_stats(q, k, v, None, dict(is_causal=False, enable_gqa=False))
    torch.testing.assert_close(st["col_sum"].double(), want_cols, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="forward_stats_has_kernel"):
        attention_stats(q, k, v, row_entropy=True, method="fused")
    with pytest.raises(RuntimeError, match="no CUDA kernel takes this problem"):
        ops.forward_stats(q, k, v, None, False, None, False, True, True, 0, 0, 1)
    qh, kh, vh = q.half(), k.half(), v.half()
    assert ops.forward_stats_has_kernel(qh, kh[:, :, :63], vh[:, :, :63], None, False, None, False, True, True, 0)
    assert not ops.forward_stats_has_kernel(qh, kh[:, :, :63], vh[:, :, :63], None, False, None, False, True, True, 2)
    assert not ops.forward_stats_has_kernel(qh[..., :60], kh[..., :60], vh, None, False, None, False, True, True, 0)
    # ... and an odd key count with a window goes to the chunks under auto, with the right rows
    _, P = sdpa_math.attention(qh, kh[:, :, :63], vh[:, :, :63])
    _, st = attention_stats(qh, kh[:, :, :63], vh[:, :, :63], rows=slice(-2, None))
    assert torch.equal(st["rows"], P[..., -2:, :])


ROWS_ALONE_CASES = {  # B, Hq, Hkv, L, S, E, causal: inputs one of PyTorch's fused kernels takes
    "causal_gqa": (2, 8, 2, 300, 300, 128, True),
    "L_lt_S_d64": (1, 4, 4, 200, 334, 64, False),
}


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(ROWS_ALONE_CASES))
def test_rows_alone_runs_the_window_rows_only(case, dtype):
    """rows alone under auto (no mask, no gradient): O from PyTorch's fused kernel, the window as
    the softmax of its rows' fp32 logits. The window is the operator's P at those rows to the
    dtype's rounding (torch.testing's default tolerance for it: a last-bit difference passes, a
    wrong mask, row or head does not), and as close to float64 as the operator's P. O is PyTorch's:
    equal to its scaled_dot_product_attention, and within rounding of the operator's."""
    B, Hq, Hkv, L, S, E, causal = ROWS_ALONE_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(L + S)
    q, k, v = (torch.randn(B, h, n, E, generator=gen, device="cuda").to(dtype) for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))
    kw = dict(is_causal=causal, enable_gqa=Hq != Hkv)
    O, P = sdpa_math.attention(q, k, v, **kw)
    _, P64, _ = reference(q, k, v, None, causal, E ** -0.5, kw["enable_gqa"])
    for win in (slice(-48, None), slice(3, 190, 37), slice(-2, None)):  # at most a quarter of the rows
        (out, st), names = cuda_kernels(lambda: attention_stats(q, k, v, rows=win, **kw))
        assert any("cudnn" in n or "flash" in n or "fmha" in n for n in names), names  # PyTorch's kernel gave O
        assert st["rows"].shape == P[..., win, :].shape and st["rows"].dtype == P.dtype
        torch.testing.assert_close(st["rows"], P[..., win, :])
        want = P64[..., win, :]
        assert rel_err(st["rows"], want) <= 1.05 * rel_err(P[..., win, :], want), win
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw))
        torch.testing.assert_close(out, O, rtol=1e-2, atol=2e-3)
    # more than a quarter of the rows, or another statistic asked with them: the statistics
    # kernel, whose window is P's bits
    for win, more in ((slice(-L // 4 - 1, None), {}), (slice(-48, None), dict(row_entropy=True))):
        (_, st), names = cuda_kernels(lambda: attention_stats(q, k, v, rows=win, **more, **kw))
        assert not any("cudnn" in n or "flash" in n or "fmha" in n for n in names), names
        assert torch.equal(st["rows"], P[..., win, :]), win
