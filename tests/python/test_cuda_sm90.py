"""The Hopper forward (src/cuda/sm90/) on an sm_90 GPU: that it is the kernel that runs, and that
its O, P and lse match the float64 reference over the inputs real models pass: contiguous and
transposed (B, L, H, E) views, head sizes 40-128 with Ev != E, bool and float masks in every
broadcast form, causal with L != S, GQA, key tails, fully masked rows, and NaN scores.

Every output starts as NaN (SDPA_MATH_POISON_OUTPUTS=1): an element the kernel does not write
fails the comparison. Skipped without an sm_90 device.
"""
import pytest
import torch

import sdpa_math
from cuda_helpers import HALF_DTYPES, cuda_kernels, dtype_id, make, make_mask, reference, sm90_only

pytestmark = sm90_only

aten_math = torch.ops.aten._scaled_dot_product_attention_math
DTYPES = HALF_DTYPES
ids = dtype_id
# P is rounded once from fp32 (u/2 of the dtype); O from weights rounded to the dtype.
TOL = {torch.float16: (2e-3, 2e-4), torch.bfloat16: (1.6e-2, 2e-3)}


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("SDPA_MATH_POISON_OUTPUTS", "1")


SHAPES = [  # B, Hq, Hkv, L, S, E, Ev
    (2, 3, 3, 130, 200, 64, 64),
    (1, 2, 2, 257, 1100, 128, 128),
    (2, 2, 2, 100, 300, 80, 80),
    (1, 2, 2, 70, 130, 96, 128),
    (1, 4, 2, 190, 250, 128, 96),
    (2, 2, 1, 64, 64, 40, 56),
    # P's rows not 16-byte aligned (copied out by the warpgroup, not TMA) at head 64 too
    (2, 3, 3, 130, 204, 64, 64),
    (1, 2, 2, 70, 250, 64, 64),
    # odd S: P's rows 2-byte aligned; a warp's rows start 4-byte aligned or 2 bytes past (the
    # copy's two forms), from head to head too
    (2, 2, 1, 130, 201, 64, 64),
    (1, 2, 2, 257, 1101, 128, 128),
    # last key tiles of 1 and 2 keys: fewer than the copy's shift
    (1, 3, 3, 70, 129, 64, 64),
    (2, 1, 1, 67, 258, 128, 128),
]


def run_case(dtype, shape, layout, mask_kind, causal, seed):
    B, Hq, Hkv, L, S, E, Ev = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = make((B, Hq, L, E), dtype, layout, gen), make((B, Hkv, S, E), dtype, layout, gen), \
        make((B, Hkv, S, Ev), dtype, layout, gen)
    mask = make_mask(mask_kind, B, Hq, L, S, dtype, gen)
    gqa = Hq != Hkv
    (out, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, mask, 0.0, causal, enable_gqa=gqa))
    assert any("forward_sm90" in n for n in names), names
    ref_out, ref_p, _ = reference(q, k, v, mask, causal, E ** -0.5, gqa)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs.double(), ref_p, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol * 5, atol=atol * 20)
    return q, k, v, mask, out, probs


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}kv{}L{}S{}E{}Ev{}".format(*s))
@pytest.mark.parametrize("layout", ["contig", "blhe"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_forward_unmasked(dtype, shape, layout, causal):
    run_case(dtype, shape, layout, "none", causal, seed=sum(shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("mask_kind", ["float_b1ls", "float_full", "float32_b1ls", "float_ls", "bool_keypad", "bool_full"])
@pytest.mark.parametrize("layout", ["contig", "blhe"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 150, 334, 128, 128), (2, 2, 2, 100, 300, 64, 64)],
                         ids=["S334E128", "S300E64"])  # P copied out in 4- and 8-byte stores
def test_sm90_forward_masked(dtype, mask_kind, layout, shape):
    run_case(dtype, shape, layout, mask_kind, causal=False, seed=7)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_sm90_bool_mask_with_a_scale_that_rounds_to_zero(dtype):
    """A scale below fp32's smallest subnormal is 0 in the kernel: every visible logit is 0, so P
    is uniform over the visible keys and 0 at the hidden one. Clean tiles of a bool mask keep raw
    scores (-inf at hidden keys) only with a positive fp32 scale: with the scale tested as a
    double, -inf times 0 made the row NaN."""
    B, H, L, S, E = 1, 2, 128, 256, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(B, H, n, E, generator=gen, device="cuda").to(dtype) for n in (L, S, S))
    mask = torch.ones(B, 1, L, S, dtype=torch.bool, device="cuda")
    mask[0, 0, 3, 5] = False
    (out, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, mask, scale=1e-46))
    assert any("forward_sm90" in n for n in names), names
    expect = torch.full((L, S), 1.0 / S, device="cuda", dtype=torch.float64)
    expect[3] = 1.0 / (S - 1)
    expect[3, 5] = 0.0
    torch.testing.assert_close(probs[0].double(), expect.expand(H, L, S), rtol=TOL[dtype][0], atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("kind", ["bool", "same", "float32"])
def test_sm90_mask_tiles_left_out_only_where_neutral(dtype, kind):
    """A warp leaves a tile's mask out when its pairs change no logit of the warp (every key
    visible, or every value +-0). One element is enough to make a tile masked: a single hidden
    key (or a single nonzero value, -inf, or NaN) at one row of one warp,
    in each of several tiles, rows and key columns, with -0.0 elsewhere in the float forms. A
    byte of 2 in a bool mask is a visible key that the tile test does not take for one: the tile
    then takes the masked path, with the same P. A row of a float mask held at finfo.min gives
    the reference's P (an fp16 mask is taken in base-2 units, the others in natural units)."""
    B, H, L, S, E = 2, 2, 256, 512, 128
    gen = torch.Generator(device="cuda").manual_seed(47)
    q, k, v = (torch.randn(B, H, n, E, generator=gen, device="cuda").to(dtype) for n in (L, S, S))
    spots = [(0, 0, 0), (0, 17, 131), (0, 77, 255), (1, 130, 256), (1, 255, 511), (1, 64, 383)]  # (b, row, key)
    if kind == "bool":
        mask = torch.ones(B, 1, L, S, dtype=torch.uint8, device="cuda")
        for b, i, j in spots:
            mask[b, 0, i, j] = 0
        mask[0, 0, 200, 300] = 2  # visible
        mask = mask.view(torch.bool)
    else:
        mdt = dtype if kind == "same" else torch.float32
        mask = torch.full((B, 1, L, S), -0.0, dtype=mdt, device="cuda")
        for (b, i, j), val in zip(spots, [0.5, -0.75, float("-inf"), 2.0, -3.0, float("-inf")]):
            mask[b, 0, i, j] = val
        mask[1, 0, 10, 20] = float("nan")  # that row is NaN
        mask[0, 0, 5] = torch.finfo(mdt).min  # a row held at the lowest: still finite logits
    (out, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, mask))
    assert any("forward_sm90" in n for n in names), names
    if kind == "bool":
        ref_out, ref_p, _ = reference(q, k, v, mask.view(torch.uint8) != 0, False, E ** -0.5, False)
        assert all((probs[b, :, i, j] == 0).all() for b, i, j in spots)
        assert (probs[0, :, 200, 300] > 0).all()
    else:
        assert probs[1, :, 10].isnan().all() and out[1, :, 10].isnan().all()
        mask[1, 0, 10, 20] = 0.0  # the NaN row checked: the rest against the reference
        ref_out, ref_p, _ = reference(q, k, v, mask, False, E ** -0.5, False)
        probs[1, :, 10], out[1, :, 10] = ref_p[1, :, 10], ref_out[1, :, 10]
        assert (probs[0, :, 77, 255] == 0).all() and (probs[1, :, 64, 383] == 0).all()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs.double(), ref_p, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol * 5, atol=atol * 20)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("kind", ["bool", "same", "float32"])
@pytest.mark.parametrize("form,L", [("1hls", 100), ("ls", 100), ("b11s", 100), ("bhls", 100), ("b1ls", 12), ("ls", 12)])
def test_sm90_mask_plan(dtype, kind, form, L):
    """A float mask is read once by a plan kernel (build_mask_plan), whose bits say which 128-key
    tiles leave a warp's 16 rows unchanged; the forward loads no pairs of those. A bool mask has
    no plan: the warps vote on its pairs. Forms: (1, H, L, S) broadcast over the batch (the plan
    numbers heads, not batches), (L, S) (one plan for all), (B, 1, 1, S) (one row group), (B, 1,
    L, S) and (L, S) with L = 12 (one row group of 12 rows of their own: the review's case, read
    as row 0 alone at first), and (B, H, L, S) (a plan per head). S = 4500 gives 36 key
    tiles, two plan words, the last tile partial. Spots that change one logit each sit in tiles
    0, 31, 32, 33 and 35 (past the first word), at rows 0, 15, 16, 63 and 99 (a group's edges,
    the last row; modulo L), each mask slice's spots moved by two keys a slice, so a plan bit
    read for the wrong slice leaves some spot unmasked: its P is then not 0 (hidden) or not
    raised (a finite value)."""
    B, H, S, E = 3, 2, 4500, 64
    gen = torch.Generator(device="cuda").manual_seed(61)
    q, k, v = (torch.randn(B, H, n, E, generator=gen, device="cuda").to(dtype) for n in (L, S, S))
    shape = {"1hls": (1, H, L, S), "ls": (L, S), "b11s": (B, 1, 1, S), "bhls": (B, H, L, S), "b1ls": (B, 1, L, S)}[form]
    spots = [(0, 0), (15, 31 * 128 + 5), (16, 32 * 128), (63, 33 * 128 + 127), (99, 4499)]  # (row, key)
    if kind == "bool":
        mask = torch.ones(shape, dtype=torch.bool, device="cuda")
    else:
        mask = torch.zeros(shape, dtype=dtype if kind == "same" else torch.float32, device="cuda")
    hidden = torch.zeros(shape, dtype=torch.bool, device="cuda")
    raised = torch.zeros(shape, dtype=torch.bool, device="cuda")
    slices = [[]] if len(shape) == 2 else \
        torch.cartesian_prod(*[torch.arange(n) for n in shape[:-2]]).view(-1, len(shape) - 2).tolist()
    for slot, lead in enumerate(slices):  # each mask slice's lead coordinates
        for n, (i, j) in enumerate(spots):
            i = 0 if form == "b11s" else i % L
            j = j + 2 * slot if j + 2 * slot < S else j - 2 * slot
            at = (*lead, i, j)
            if n % 2 == 0 or kind == "bool":
                mask[at] = False if kind == "bool" else float("-inf")
                hidden[at] = True
            else:  # a finite value changes a logit too: e^12 times the key's weight
                mask[at] = 12.0
                raised[at] = True
    (out, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, mask))
    assert any("forward_sm90" in n for n in names), names
    assert any("build_mask_plan" in n for n in names) == (kind != "bool"), names
    full = (B, H, L, S)
    assert (probs[hidden.expand(full)] == 0).all()
    if kind != "bool":
        rows = raised.expand(full).any(-1)
        assert ((probs * raised.expand(full)).sum(-1)[rows] > 0.25).all()
    ref_out, ref_p, _ = reference(q, k, v, mask, False, E ** -0.5, False)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs.double(), ref_p, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol * 5, atol=atol * 20)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("form,S", [("b11s", 700), ("b1ls", 700), ("b1ls", 704), ("causal_b1ls", 704)])
def test_sm90_padded_key_tiles(dtype, form, S):
    """Bool masks that hide whole 128-key tiles at the end of some CTAs' rows: the kernel stops
    before them and writes their P as the causal tail's zeros. Batches with 700 (all), 450, 256
    and 0 visible keys (a whole tile and a part, exactly two tiles, nothing: P = O = 0, lse =
    -inf). b11s: a key-padding mask (B, 1, 1, S). b1ls: (B, 1, L, S), rows past 128 seeing 200
    more keys than the first row block, so CTAs of one head stop at different tiles; with S = 704
    its rows are 16-byte aligned and scanned two tiles a step, with 700 they are not scanned.
    causal_b1ls: Hugging Face's causal-and-padding mask as one (B, 1, L, S) bool tensor (row i
    sees keys <= i), whose upper triangle the scan skips. NaN keys at hidden keys change nothing
    (contract §13); a NaN query row is NaN at every key, the skipped ones too."""
    B, H, L, E = 4, 2, 300, 128
    gen = torch.Generator(device="cuda").manual_seed(23)
    q, k, v = (torch.randn(B, H, n, E, generator=gen, device="cuda").to(dtype) for n in (L, S, S))
    valid = torch.tensor([S, 450, 256, 0], device="cuda")
    keys = torch.arange(S, device="cuda")
    if form == "b11s":
        mask = (keys < valid[:, None])[:, None, None, :].contiguous()
    elif form == "b1ls":
        ends = valid[:, None] - 200 + 200 * (torch.arange(L, device="cuda") >= 128)  # (B, L)
        mask = (keys < ends[..., None].clamp(min=0))[:, None].contiguous()
    else:
        causal = keys <= torch.arange(L, device="cuda")[:, None]  # (L, S), top-left
        mask = (causal & (keys < valid[:, None, None]))[:, None].contiguous()
    k[1, :, 600:] = float("nan")  # hidden from every row of batch 1
    (out, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, mask))
    assert any("forward_sm90" in n for n in names), names
    k[1, :, 600:] = 0.0
    ref_out, ref_p, ref_lse = reference(q, k, v, mask, False, E ** -0.5, False)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs.double(), ref_p, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol * 5, atol=atol * 20)
    assert (probs[3] == 0).all() and (out[3] == 0).all()
    lse = torch.ops.sdpa_math.forward(q, k, v, mask, 0.0, False, None, None, False, None)[2]
    assert torch.isneginf(lse[3]).all()
    torch.testing.assert_close(lse[:3].double(), ref_lse[:3], rtol=1e-5, atol=1e-5)
    q[2, 1, 7, 0] = float("nan")  # batch 2's first row block stops after at most two tiles
    probs = sdpa_math.attention(q, k, v, mask)[1]
    assert probs[2, 1, 7].isnan().all() and not probs[2, 1, 8].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_sm90_nan_at_a_key_a_bool_mask_hides_is_ignored(dtype):
    """Contract §13: a key the row does not attend to takes no part in it, NaN included. Key 40
    of a 200-key tile the CTA runs is NaN and hidden from every row by a (L, S) bool mask."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen, device="cuda").to(dtype) for n in (130, 200, 200))
    k[0, 1, 40] = float("nan")
    mask = torch.ones(130, 200, dtype=torch.bool, device="cuda")
    mask[:, 40] = False
    (out, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, mask))
    assert any("forward_sm90" in n for n in names), names
    assert not probs.isnan().any() and not out.isnan().any()
    assert (probs[..., 40] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_sm90_lse_matches_reference(dtype):
    """lse is what the backward reads: compare it through the op's own output."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 64, generator=gen, device="cuda").to(dtype) for _ in range(3))
    res, names = cuda_kernels(lambda: torch.ops.sdpa_math.forward(q, k, v, None, 0.0, True, None, None, False, None))
    assert any("forward_sm90" in n for n in names), names
    lse = res[2]
    _, _, ref_lse = reference(q, k, v, None, True, 64 ** -0.5, False)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_sm90_nan_score_gives_nan_row_like_the_math_op(dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(1, 2, 130, 64, generator=gen, device="cuda").to(dtype) for _ in range(3))
    q[0, 1, 17, 3] = float("nan")
    out, probs = sdpa_math.attention(q, k, v)
    nat_out, nat_probs = aten_math(q, k, v)
    assert torch.equal(probs.isnan(), nat_probs.isnan()) and probs[0, 1, 17].isnan().all()
    assert torch.equal(out.isnan(), nat_out.isnan())
    ok = ~probs.isnan()
    torch.testing.assert_close(probs[ok], nat_probs[ok], rtol=TOL[dtype][0], atol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("S", [300, 301, 384], ids=["pairs", "odd", "16-byte"])  # the tail's store paths
def test_sm90_causal_nan_row_is_nan_right_of_its_tile_too(dtype, S):
    """The math op's causal softmax of a NaN row is NaN at every key, the hidden ones too (contract:
    prob_of_hidden_key). Row 5 lies in the first 128-row tile, whose CTA stops at key 128; the
    other rows keep zeros there."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(1, 2, 130, 64, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(1, 2, S, 64, generator=gen, device="cuda").to(dtype) for _ in range(2))
    q[0, 1, 5, 3] = float("nan")
    (_, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, is_causal=True))
    assert any("forward_sm90" in n for n in names), names
    assert aten_math(q.float(), k.float(), v.float(), is_causal=True)[1][0, 1, 5].isnan().all()
    assert probs[0, 1, 5].isnan().all()
    others = torch.ones(128, dtype=torch.bool, device="cuda")  # tile 0's rows (rows 128.. see key 128)
    others[5] = False
    assert (probs[0, 1, :128][others, 128:] == 0).all() and (probs[0, 0, :128, 128:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_sm90_errors_no_larger_than_the_math_ops(dtype):
    """Issue target: P's error <= the math op's x 1.05, O's <= flash attention's x 1.05 (vs float64)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 8, 512, 128, generator=gen, device="cuda").to(dtype) for _ in range(3))
    out, probs = sdpa_math.attention(q, k, v)
    nat_out, nat_probs = aten_math(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash_out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    ref_out, ref_p, _ = reference(q, k, v, None, False, 128 ** -0.5, False)
    err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert err(probs, ref_p) <= 1.05 * err(nat_probs, ref_p)
    assert err(out, ref_out) <= 1.05 * err(flash_out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_sm90_float_mask_errors_no_larger_than_the_math_ops(dtype):
    """The same target under a (B, 1, L, S) float mask of the inputs' dtype whose rows mix tiles
    left raw (all zero: bf16's take the base-2 exponent, exponent_of) with tiles it changes (small
    values in keys 256-383, the dtype's min on the last 100 keys), and one row held at the min
    everywhere (P uniform, as the math op's)."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(2, 8, 512, 128, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(2, 8, 1024, 128, generator=gen, device="cuda").to(dtype) for _ in range(2))
    mask = torch.zeros(2, 1, 512, 1024, device="cuda", dtype=dtype)
    mask[..., 256:384] = torch.randn(2, 1, 512, 128, generator=gen, device="cuda").to(dtype)
    mask[..., 924:] = torch.finfo(dtype).min
    mask[:, :, 5] = torch.finfo(dtype).min
    (out, probs), names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, mask))
    assert any("forward_sm90" in n for n in names), names
    _, nat_probs = aten_math(q, k, v, mask)
    ref_out, ref_p, _ = reference(q, k, v, mask, False, 128 ** -0.5, False)
    err = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    assert err(probs, ref_p) <= 1.05 * err(nat_probs, ref_p)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs[:, :, 5].double(), ref_p[:, :, 5], rtol=rtol, atol=atol)
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol * 5, atol=atol * 20)


def test_dropout_and_head_size_256_take_the_mma_sync_kernel():
    """What the Hopper forward declines runs elsewhere (and is checked there, test_cuda.py)."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(1, 2, 100, 256, generator=gen, device="cuda").half() for _ in range(3))
    _, names = cuda_kernels(lambda: sdpa_math.attention(q, k, v))
    assert not any("forward_sm90" in n for n in names)
    q, k, v = (x[..., :64] for x in (q, k, v))
    _, names = cuda_kernels(lambda: sdpa_math.attention(q, k, v, None, 0.1, False))
    assert not any("forward_sm90" in n for n in names)
