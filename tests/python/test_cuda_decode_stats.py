"""The statistics of P for up to 4 query rows (decode) on the decode kernels (decode/stats.cu,
decode_stats; issue 16), on any CUDA GPU: that attention_stats takes them, that column sums and
row entropy are within 1e-5 (relative) of float64 on the same rounded inputs, that O and lse are
the decode forward's own, bit for bit, and the window's rows its P; the contract's rows (NaN,
fully masked), masks, causal, GQA, transposed layouts, fp32 inputs, and heads in several passes.

Before this path, decode shapes took the Hopper statistics kernel (a 128-row tile for 1 row, K
read twice, slower than the chunks of P) or, off Hopper and for fp32, the chunks.

Every output starts as NaN (SDPA_MATH_POISON_OUTPUTS=1): an element the kernels do not write fails
the comparison. Skipped without a CUDA device.
"""
import pytest
import torch

import sdpa_math
from cuda_helpers import assert_stats_match_float64, cuda_kernels, dtype_id, make, ref_stats, rel_err
from sdpa_math.stats import attention_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
ops = torch.ops.sdpa_math
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("SDPA_MATH_POISON_OUTPUTS", "1")


CASES = {  # B, Hq, Hkv, L, S, E, Ev, mask kind, causal, layout; the decode kernels each takes
    "mha_1_row": (4, 8, 8, 1, 600, 128, 128, "none", False, "contig"),    # tensor cores (fp16/bf16), a warp a row
    "odd_S_3_rows": (3, 2, 2, 3, 77, 64, 64, "none", False, "contig"),    # one key block, 77 keys: a tail of 1
    "gqa_long_blhe": (2, 8, 2, 1, 5000, 128, 128, "none", False, "blhe"),  # decode_finalize; 3 CTAs a row
    "rows_4_long": (1, 2, 2, 4, 4500, 64, 64, "none", False, "contig"),  # 3 CTAs a row, 4 rows a head
    "causal_4_rows": (1, 2, 2, 4, 300, 64, 64, "none", True, "contig"),   # CUDA cores: hidden keys at -inf
    "keypad_d80_Ev96": (2, 2, 2, 2, 1030, 80, 96, "bool_keypad", False, "contig"),
    "float_full_d256": (1, 2, 2, 2, 333, 256, 256, "float_full", False, "contig"),
    "float_ls_gqa": (2, 4, 2, 2, 129, 64, 64, "float_ls", False, "blhe"),
}


def make_decode_mask(kind, B, H, L, S, dtype, gen):
    if kind == "none":
        return None
    if kind == "bool_keypad":  # (B, 1, 1, S): the last 7 (b + 1) keys of batch b padded
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda")
        for b in range(B):
            keep[b, ..., S - 7 * (b + 1):] = False
        return keep
    if kind == "float_full":
        return torch.randn(B, H, L, S, generator=gen, device="cuda").to(dtype)
    if kind == "float_ls":
        return torch.randn(L, S, generator=gen, device="cuda").to(dtype)
    raise ValueError(kind)


def inputs(name, dtype, seed=0):
    B, Hq, Hkv, L, S, E, Ev, mask_kind, causal, layout = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed + L + S)
    q, k, v = make((B, Hq, L, E), dtype, layout, gen), make((B, Hkv, S, E), dtype, layout, gen), \
        make((B, Hkv, S, Ev), dtype, layout, gen)
    return q, k, v, make_decode_mask(mask_kind, B, Hq, L, S, dtype, gen), dict(is_causal=causal, enable_gqa=Hq != Hkv)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("name", list(CASES))
def test_decode_statistics_are_within_1e_5_of_float64(name, dtype):
    q, k, v, mask, kw = inputs(name, dtype)
    L = q.shape[-2]
    win = slice(1, None) if L > 1 else slice(0, 1)
    assert ops.forward_stats_has_kernel(q, k, v, mask, kw["is_causal"], None, kw["enable_gqa"], True, True,
                                        len(range(*win.indices(L))))
    (out, st), names = cuda_kernels(lambda: attention_stats(q, k, v, mask, col_sum="per_head", row_entropy=True,
                                                            rows=win, method="fused", **kw))
    assert any("decode_stats" in n for n in names) and not any("forward_sm90" in n for n in names), names
    assert_stats_match_float64(st, q, k, v, mask, kw)
    # The same partial and finalize kernels as the forward, which only also writes P: its O and
    # lse bit for bit; the window's rows are P's bits too (each row's max and sum combined over
    # its key blocks in the finalize's order, then exp(s - m) * (1 / l), rounded alike).
    O, P, lse = sdpa_math.attention_with_lse(q, k, v, mask, **kw)
    _, lse_stats, *_ = ops.forward_stats(q, k, v, mask, kw["is_causal"], None, kw["enable_gqa"], True, False, 0, 0, 1)
    assert torch.equal(out, O) and torch.equal(lse_stats, lse)
    assert st["rows"].dtype == P.dtype and torch.equal(st["rows"], P[..., win, :])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("asked", ["cols", "ent", "rows"])
def test_each_statistic_alone(dtype, asked):
    """One statistic at a time: the others' outputs absent, the one asked still right (the kernel
    must not write through an absent output)."""
    q, k, v, mask, kw = inputs("keypad_d80_Ev96", dtype)
    want_cols, want_ent = ref_stats(q, k, v, mask, kw)
    _, st = attention_stats(q, k, v, mask, col_sum="per_head" if asked == "cols" else None,
                            row_entropy=asked == "ent", rows=slice(-1, None) if asked == "rows" else None,
                            method="fused", **kw)
    assert list(st) == [{"cols": "col_sum", "ent": "row_entropy", "rows": "rows"}[asked]]
    if asked == "cols":
        assert rel_err(st["col_sum"], want_cols) <= 1e-5
    elif asked == "ent":
        assert rel_err(st["row_entropy"], want_ent) <= 1e-5
    else:
        _, P = sdpa_math.attention(q, k, v, mask, **kw)
        torch.testing.assert_close(st["rows"], P[..., -1:, :], rtol=4e-3, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_nan_and_fully_masked_rows(dtype):
    """A NaN score: that row's entropy, O and lse are NaN and its head's column sums NaN at every
    key; a row that sees no key: entropy 0, O 0, lse -inf, and it adds nothing to the sums."""
    q, k, v, _, kw = inputs("causal_4_rows", dtype)
    kw["is_causal"] = False
    q = q.clone()
    q[0, 1, 2, 3] = float("nan")
    mask = torch.ones(1, 1, 4, k.shape[-2], dtype=torch.bool, device="cuda")
    mask[..., 1, :] = False  # row 1 of every head sees no key
    out, lse, cols, ent, _ = ops.forward_stats(q, k, v, mask, False, None, False, True, True, 0, 0, 1)
    assert torch.isnan(ent[0, 1, 2]) and torch.isnan(out[0, 1, 2]).all() and torch.isnan(lse[0, 1, 2])
    assert ent.isnan().sum() == 1 and cols[0, 1].isnan().all() and not cols[0, 0].isnan().any()
    assert (ent[..., 1] == 0).all() and (out[..., 1, :] == 0).all() and (lse[..., 1] == float("-inf")).all()
    keep = torch.tensor([True, False, True, True], device="cuda")
    _, _, cols3, _, _ = ops.forward_stats(q[:, :1][..., keep, :], k[:, :1], v[:, :1], mask[..., keep, :], False, None,
                                          False, True, False, 0, 0, 1)
    torch.testing.assert_close(cols[:, :1], cols3, rtol=1e-6, atol=1e-7)


def test_group_and_visible_options_agree_with_the_chunks():
    q, k, v, mask, kw = inputs("float_ls_gqa", torch.float16)
    for mode in ("per_head", "group_sum", "group_mean"):
        for vn in (False, True):
            a = attention_stats(q, k, v, mask, col_sum=mode, visible_normalized=vn, method="fused", **kw)[1]
            b = attention_stats(q.float(), k.float(), v.float(), mask.float(), col_sum=mode, visible_normalized=vn,
                                method="chunks", **kw)[1]
            torch.testing.assert_close(a["col_sum"], b["col_sum"], rtol=2e-5, atol=1e-5)


def test_many_heads_take_several_passes_with_the_same_sums():
    """240 heads of 4 rows x 16384 keys: the decode workspace (64 MiB) holds about 226 heads, so
    the heads go in two passes (two launches of each kernel). Against the fp32 chunks on the same
    rounded inputs, and the same bits on a second call (no atomics)."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(1, 240, 4, 64, generator=gen, device="cuda").half()
    k, v = (torch.randn(1, 240, 16384, 64, generator=gen, device="cuda").half() for _ in range(2))
    (_, a), names = cuda_kernels(lambda: attention_stats(q, k, v, col_sum="per_head", row_entropy=True,
                                                         method="fused"))
    assert sum("decode_stats" in n for n in names) == 2, names
    b = attention_stats(q, k, v, col_sum="per_head", row_entropy=True, method="fused")[1]
    want = attention_stats(q.float(), k.float(), v.float(), col_sum="per_head", row_entropy=True, method="chunks")[1]
    for key in ("col_sum", "row_entropy"):
        assert torch.equal(a[key], b[key]), key
        assert rel_err(a[key], want[key].double()) <= 2e-5, key


def test_auto_takes_the_decode_kernels_rows_alone_too():
    """method='auto' on a decode problem: the statistics from the decode kernels (no chunks of P),
    rows alone too (not _rows_alone's PyTorch forward plus the window's logits: the decode kernels
    read K and V once for both)."""
    q, k, v, _, kw = inputs("mha_1_row", torch.float16)
    _, P = sdpa_math.attention(q, k, v, **kw)
    (_, st), names = cuda_kernels(lambda: attention_stats(q, k, v, col_sum="group_sum", row_entropy=True, **kw))
    assert any("decode_stats" in n for n in names), names
    torch.testing.assert_close(st["col_sum"], P.float().sum(-2), rtol=4e-3, atol=1e-6)
    (_, st), names = cuda_kernels(lambda: attention_stats(q, k, v, rows=slice(-1, None), **kw))
    assert any("decode_stats" in n for n in names), names
    torch.testing.assert_close(st["rows"], P, rtol=4e-3, atol=1e-7)


def test_keys_past_the_statistics_grid_keep_the_plain_forward_and_leave_the_statistics_to_others():
    """S = 150 million keys (K and V one row broadcast over the keys, no memory): more 2048-key
    chunks than a grid's second dimension takes (65535). The statistics kernels decline it (a
    review found they threw CudaFailure from forward_stats instead of declining), and the plain
    decode forward, whose finalize takes 4096 keys a CTA, still runs it."""
    S = 150_000_000
    q = torch.randn(1, 1, 1, 8, device="cuda")  # fp32: P = 1 / S is below fp16's subnormals
    k = torch.zeros(1, 1, 1, 8, device="cuda").expand(1, 1, S, 8)
    v = torch.ones(1, 1, 1, 8, device="cuda").expand(1, 1, S, 8)
    assert not ops.forward_stats_has_kernel(q, k, v, None, False, None, False, True, True, 0)
    assert ops.forward_stats_has_kernel(q, k[:, :, :4096], v[:, :, :4096], None, False, None, False, True, True, 0)
    out, P = sdpa_math.attention(q, k, v)
    torch.testing.assert_close(out, torch.ones_like(out), rtol=1e-5, atol=0)  # every key weighs 1 / S, V is ones
    torch.testing.assert_close(P[0, 0, 0, ::10_000_000], torch.full((15,), 1 / S, device="cuda"), rtol=1e-3, atol=0)
