"""NaN scores and a zero head size, on the CPU and CUDA, against PyTorch's math op.

- A NaN logit in a row (from Q, K, or a float mask, with causal or other masked keys too) makes
  that row of P and O NaN, and its lse NaN, as the math op's softmax does; other rows are
  untouched. float64 runs the float64 reference, the other dtypes the CPU kernels (whose row
  maximum skipped NaN: the row came out as zeros, or as fully masked, before). On CUDA the same
  for each path but the Hopper kernels (mma.sync, decode, cuBLAS fp32, generic), chosen by the
  inputs, with the lse against float64 (skipped without a GPU).
- E = 0 (query/key head size zero): every score is an empty sum, 0, so P is uniform over the
  unmasked keys and O = P V, as the math op gives. The default scale 1/sqrt(0) = inf made
  0 * inf a NaN and every row read as fully masked (P = O = 0) before.

Not matched, deliberately: a NaN score at a key the row does not attend to (causal-hidden, or a
bool-mask False) is ignored here; the math op adds -inf to it and gets NaN for the whole row.
"""
import math

import pytest
import torch

import sdpa_math
from cases import FORWARD_TOL, Case, build, native
from cuda_helpers import cuda_kernels

aten_math = torch.ops.aten._scaled_dot_product_attention_math
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
IDS = lambda d: str(d).split(".")[-1]  # noqa: E731
NAN = float("nan")


def _qkv(dtype, E=8, L=5, S=7, Ev=6):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(2, 3, L, E, generator=g).to(dtype), torch.randn(2, 3, S, E, generator=g).to(dtype),
            torch.randn(2, 3, S, Ev, generator=g).to(dtype))


def _nan_case(name, dtype):
    """(q, k, v, mask, causal, rows): `rows` (b, h, i) are the rows the math op makes NaN."""
    q, k, v = _qkv(dtype)
    mask, causal = None, False
    if name == "query_element":  # one row's scores all NaN
        q[1, 2, 3, 0] = NAN
    elif name == "key_element":  # one column of every row of a head
        k[0, 1, 4, 5] = NAN
    elif name == "float_mask_element":  # one score of one row, every head
        mask = torch.zeros(5, 7, dtype=dtype)
        mask[2, 6] = NAN
    elif name == "nan_among_masked":  # the row's only other keys are -inf
        mask = torch.full((5, 7), -math.inf, dtype=dtype)
        mask[:, 0] = 0.0
        mask[4, 1] = NAN
    elif name == "causal_query_row":  # causal: the NaN row still NaN over the keys it cannot see
        q[0, 0, 1, 2] = NAN
        causal = True
    elif name == "causal_visible_key":  # key 0, seen by every row of one head
        k[1, 1, 0, 0] = NAN
        causal = True
    return q, k, v, mask, causal


NAN_CASES = ["query_element", "key_element", "float_mask_element", "nan_among_masked", "causal_query_row",
             "causal_visible_key"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", NAN_CASES)
def test_nan_score_gives_nan_row_like_the_math_op(name, dtype):
    q, k, v, mask, causal = _nan_case(name, dtype)
    out, probs, lse = sdpa_math.attention_with_lse(q, k, v, mask, is_causal=causal)
    # Native in float32 for the half types (it computes in float32 too), on the same inputs.
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    ref_out, ref_probs = aten_math(q.to(wide), k.to(wide), v.to(wide), attn_mask=None if mask is None else mask.to(wide),
                                   is_causal=causal)
    nan_rows = ref_probs.isnan().any(-1)
    assert nan_rows.any() and not nan_rows.all()  # the case does what it says
    assert torch.equal(probs.isnan(), ref_probs.isnan())
    assert torch.equal(out.isnan(), ref_out.isnan())
    assert probs[nan_rows].isnan().all() and out[nan_rows].isnan().all()
    assert torch.equal(lse.isnan(), nan_rows), "lse is NaN exactly on the NaN rows"
    rtol, atol = FORWARD_TOL[dtype]
    torch.testing.assert_close(probs.to(wide), ref_probs, rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(out.to(wide), ref_out, rtol=rtol, atol=atol * 40, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_nan_row_gradients_are_nan_where_the_math_ops_are(dtype):
    q, k, v, _, _ = _nan_case("query_element", dtype)
    grads = []
    for f in (lambda a, b, c: aten_math(a, b, c), lambda a, b, c: sdpa_math.attention(a, b, c)):
        a, b, c = (x.clone().requires_grad_(True) for x in (q, k, v))
        out, probs = f(a, b, c)
        grads.append(torch.autograd.grad(out.sum() + probs.sum(), (a, b, c)))
    for ours, ref in zip(grads[1], grads[0]):
        assert ref.isnan().any()
        assert torch.equal(ours.isnan(), ref.isnan())


E0_CASES = ["plain", "causal", "float_mask", "bool_mask", "explicit_scale"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", E0_CASES)
def test_head_size_zero_like_the_math_op(name, dtype):
    q, k, v = _qkv(dtype, E=0)
    L, S = q.shape[-2], k.shape[-2]
    mask, causal, scale = None, False, None
    if name == "causal":
        causal = True
    elif name == "float_mask":
        mask = torch.randn(L, S).to(dtype)
        mask[:, 1] = -math.inf
    elif name == "bool_mask":
        mask = torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[:, 0] = True
    elif name == "explicit_scale":
        scale = 0.3
    out, probs, lse = sdpa_math.attention_with_lse(q, k, v, mask, is_causal=causal, scale=scale)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    # The public API's bool mask is True = attend; native's direct call adds 0/1, so give it -inf.
    ref_mask = None
    if mask is not None:
        ref_mask = torch.zeros(L, S, dtype=wide).masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else mask.to(wide)
    ref_out, ref_probs = aten_math(q.to(wide), k.to(wide), v.to(wide), attn_mask=ref_mask, is_causal=causal, scale=scale)
    assert not probs.isnan().any() and not out.isnan().any() and not lse.isnan().any()
    rtol, atol = FORWARD_TOL[dtype]
    torch.testing.assert_close(probs.to(wide), ref_probs, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.to(wide), ref_out, rtol=rtol, atol=atol * 40)
    # Scores are 0 (plus the mask), so lse = log sum exp(mask) over the row.
    logits = torch.zeros(L, S, dtype=torch.float64)
    if ref_mask is not None:
        logits = logits + ref_mask.to(torch.float64)
    if causal:
        logits = logits.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(lse.to(torch.float64), torch.logsumexp(logits, -1).expand_as(lse), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=IDS)
def test_head_size_zero_gradients_like_the_math_op(dtype):
    q, k, v = _qkv(dtype, E=0)
    grads = []
    for f in (lambda a, b, c: aten_math(a, b, c), lambda a, b, c: sdpa_math.attention(a, b, c)):
        a, b, c = (x.clone().requires_grad_(True) for x in (q, k, v))
        out, probs = f(a, b, c)
        grads.append(torch.autograd.grad((out * out).sum() + probs.sum(), (a, b, c)))
    for ours, ref in zip(grads[1], grads[0]):
        assert ours.shape == ref.shape and not ours.isnan().any()
        torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_no_query_rows_gives_zero_gradients_like_the_math_op(dtype, device):
    """L = 0: no row reaches K, V or the mask, so their gradients are zeros, as the math op's. The
    CPU backward once left dK and dV uninitialised there (values like 3e5 or NaN): with no
    row blocks, every head counted as one a task writes whole, and no task ran."""
    q, k, v = (t.to(device) for t in _qkv(dtype, L=0))
    mask = torch.randn(1, 1, 0, 7, dtype=dtype, device=device)
    for _ in range(3):  # fresh allocations each time: garbage shows on some of them
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, mask)]
        out, probs = sdpa_math.attention(*leaves)
        grads = torch.autograd.grad((out * 2).sum() + probs.sum(), leaves, allow_unused=True)
        for g, t in zip(grads, leaves):
            assert g is None or (g.shape == t.shape and (g == 0).all()), g


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("how", ["causal", "bool_mask"])
def test_nan_at_a_key_the_row_does_not_attend_to_is_ignored(how, dtype):
    """The one deliberate difference (module docstring): the math op gets NaN + (-inf) = NaN for
    such a key and a NaN row; here a key a row does not attend to takes no part in it."""
    q, k, v = _qkv(dtype)
    k[0, 0, 6, 1] = NAN  # the last key: hidden from rows 0..4 under causal (L = 5, S = 7)
    mask = None
    if how == "bool_mask":
        mask = torch.ones(5, 7, dtype=torch.bool)
        mask[:, 6] = False
    out, probs, lse = sdpa_math.attention_with_lse(q, k, v, mask, is_causal=how == "causal")
    assert not probs.isnan().any() and not out.isnan().any() and not lse.isnan().any()
    assert (probs[..., 6] == 0).all()


# CUDA: the paths other than the Hopper kernels (test_cuda_sm90.py has its NaN case), each chosen
# by its inputs: src/cuda/backend.cu `forward` runs the first path that takes the problem (decode
# for <= 4 query rows, then the Hopper kernel, mma.sync, cuBLAS, generic). Skipped without CUDA.
# name: (dtype, L, S, E = Ev, layout, a kernel the path launches)
CUDA_PATHS = {
    # Head size 256 is past the Hopper kernel's 128, so mma.sync on every GPU. Even S: the plain
    # kernel without a mask (the per-element one with), causal zeros past key 64 stored 16 bytes
    # at a time.
    "mma_sync_fp16_e256": (torch.float16, 6, 72, 256, "contig", "forward_tc"),
    "mma_sync_bf16_e256": (torch.bfloat16, 6, 72, 256, "contig", "forward_tc"),
    # Odd S: P's rows take no pair stores; the per-element mma.sync kernel, its causal zeros one
    # at a time. Head size 60 (not a multiple of 8), which the Hopper kernel declines: it takes
    # odd S itself (test_cuda_sm90.py).
    "mma_sync_fp16_e60_odd_s": (torch.float16, 6, 71, 60, "contig", "forward_tc"),
    "cublas_fp32": (torch.float32, 6, 72, 64, "contig", "softmax_rows"),
    # Columns not unit-stride: cuBLAS declines.
    "generic_fp32_transposed": (torch.float32, 6, 72, 64, "transposed", "forward_rows"),
    "generic_fp64": (torch.float64, 6, 72, 64, "contig", "forward_rows"),
    # S = 300: two key blocks of 256, combined per row.
    "decode_fp16": (torch.float16, 4, 300, 64, "contig", "decode_finalize"),
    "decode_fp32": (torch.float32, 4, 300, 64, "contig", "decode_finalize"),
}
CUDA_NAN_CASES = ["query_element", "key_element", "float_mask_element", "causal_query_row", "beside_masked_rows"]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every output buffer starts as NaN, so an element a kernel does not write shows as NaN where
    the math op has a number."""
    monkeypatch.setenv("SDPA_MATH_POISON_OUTPUTS", "1")


def _cuda_nan_case(name, dtype, L, S, E, layout):
    """(q, k, v, mask, causal) on the GPU with a NaN score, as _nan_case."""
    (q, k, v, *_), _ = build(Case(hq=3, hkv=3, L=L, S=S, E=E, Ev=E, layout=layout), dtype, seed=11, device="cuda")
    mask, causal = None, False
    if name == "query_element":  # one row
        q[1, 1, 2, 0] = NAN
    elif name == "key_element":  # every row of one head
        k[0, 1, S - 2, 5] = NAN
    elif name == "float_mask_element":  # one row of every head
        mask = torch.zeros(L, S, dtype=dtype, device="cuda")
        mask[2, 3] = NAN
    elif name == "causal_query_row":  # also NaN over the keys the row cannot see
        q[0, 0, 1, 2] = NAN
        causal = True
    elif name == "beside_masked_rows":  # the fully masked row stays zeros, the finfo.min one uniform
        mask = torch.zeros(L, S, device="cuda")
        mask[0] = -math.inf
        mask[1] = torch.finfo(torch.float32).min
        q[1, 0, 3, 1] = NAN
    return q, k, v, mask, causal


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("path", list(CUDA_PATHS))
@pytest.mark.parametrize("name", CUDA_NAN_CASES)
def test_cuda_nan_score_gives_nan_row_like_the_math_op(name, path, poisoned_outputs):
    dtype, L, S, E, layout, kernel = CUDA_PATHS[path]
    q, k, v, mask, causal = _cuda_nan_case(name, dtype, L, S, E, layout)
    (out, probs, lse), kernels = cuda_kernels(lambda: sdpa_math.attention_with_lse(q, k, v, mask, is_causal=causal))
    assert any(kernel in n for n in kernels), f"{path} did not run {kernel}: {kernels}"
    ref_out, ref_probs = native((q, k, v, mask, 0.0, causal, None), {}, dtype)
    nan_rows = ref_probs.isnan().any(-1)
    assert nan_rows.any() and not nan_rows.all()  # the case does what it says
    assert torch.equal(probs.isnan(), ref_probs.isnan())
    assert torch.equal(out.isnan(), ref_out.isnan())
    assert probs[nan_rows].isnan().all() and out[nan_rows].isnan().all()
    rtol, atol = FORWARD_TOL[dtype]
    scale_v = max(v.abs().max().item(), 1.0)
    torch.testing.assert_close(probs.to(ref_probs.dtype), ref_probs, rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(out.to(ref_out.dtype), ref_out, rtol=rtol, atol=atol * scale_v * 10, equal_nan=True)
    # lse: NaN exactly on the NaN rows, -inf on the fully masked one, else log sum exp of the
    # logits (float64 from the same inputs).
    logits = (q.double() @ k.double().transpose(-1, -2)) * E ** -0.5
    if mask is not None:
        logits = logits + mask.double()
    if causal:
        logits = logits.masked_fill(torch.ones(L, S, dtype=torch.bool, device="cuda").triu(1), -math.inf)
    assert torch.equal(lse.isnan(), nan_rows)
    # fp32 arithmetic: scores summed over E on tensor cores (half types) or in fp32 order.
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 1e-4)
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=IDS)
def test_dropout_mask_is_read_only_inside_its_rows(device, dtype):
    # GQA decode (4 query rows, groups of 2 heads) over 235 keys, so the decode kernel's last key
    # step is partial; the explicit dropout mask is a slice of a wider tensor whose extra columns
    # are NaN, and must give exactly what its contiguous copy gives. (The CUDA decode kernel read
    # the mask at keys past the row's end before a fix. Those reads could not change a result,
    # since a key past the end has weight 0 and any mask value reads as 0 or 1, so this test
    # passed before the fix too. They were still reads outside the row, and initcheck found them.
    # The sanitizer stage of scripts/gpu_run.sh over the fuzz problems is what shows them gone.)
    g = torch.Generator().manual_seed(5)
    S, pad = 235, 128
    q = torch.randn(1, 6, 4, 64, generator=g).to(dtype).to(device)
    k, v = (torch.randn(1, 3, S, 64, generator=g).to(dtype).to(device) for _ in range(2))
    wide = torch.full((1, 6, 4, S + pad), NAN, dtype=dtype)
    wide[..., :S] = (torch.rand(1, 6, 4, S, generator=g) < 0.7).to(dtype)
    sliced = wide.to(device)[..., :S]
    assert sliced.stride(-2) == S + pad
    out, probs = sdpa_math.attention(q, k, v, None, 0.3, False, sliced, enable_gqa=True)
    ref_out, ref_probs = sdpa_math.attention(q, k, v, None, 0.3, False, sliced.contiguous(), enable_gqa=True)
    assert torch.isfinite(out).all() and torch.isfinite(probs).all()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=0)
