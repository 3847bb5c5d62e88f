"""The CUDA backend against the float64 reference and PyTorch's native op, on the GPU.

Skipped where there is no CUDA device. Every output buffer starts as NaN
(SDPA_MATH_POISON_OUTPUTS=1), so an element a kernel fails to write fails the comparison.
fp16/bf16 take the tensor-core kernels (head sizes up to 256), fp32 the cuBLAS path where its layout
allows (the generic path for strided, broadcast and transposed cases, and the backward with dropout
or a mask gradient), float64 the generic path.
"""
import zlib

import pytest
import torch

import sdpa_math
from cases import FORWARD_TOL, Case, build, cases, native

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

aten_math = torch.ops.aten._scaled_dot_product_attention_math

# Forward tolerance: the CPU suite's (cases.FORWARD_TOL). fp16/bf16 O comes from weights rounded
# to the input dtype (as in flash attention); its atol is scaled by max|V|.
TOL = FORWARD_TOL
# Backward: ||got - ref|| / (||ref|| + atol * sqrt(n)) per gradient. fp16/bf16 round dS and W to
# the input dtype for the tensor-core products and take rowsum(A . dA) as dO . O + P . dP with the
# rounded O, so a gradient that is exactly zero in float64 (S = 1: dS = 0) is a few units of
# that rounding in fp16/bf16: hence the absolute part.
GRAD_TOL = {torch.float64: (1e-10, 1e-13), torch.float32: (2e-5, 1e-6), torch.float16: (6e-3, 4e-3),
            torch.bfloat16: (4e-2, 3e-2)}
DTYPES = list(TOL)
ids = lambda d: str(d).split(".")[-1]  # noqa: E731


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setenv("SDPA_MATH_POISON_OUTPUTS", "1")


def _to_cpu64(t):
    return None if t is None else (t.detach().cpu().double() if t.is_floating_point() else t.cpu())


def _reference(args, kwargs):
    """sdpa_math on the CPU in float64 is the reference (src/reference)."""
    q, k, v, mask, p, causal, dmask = args
    return sdpa_math.attention(_to_cpu64(q), _to_cpu64(k), _to_cpu64(v), _to_cpu64(mask), p, causal,
                               _to_cpu64(dmask), **kwargs)


def _seed(case):
    return zlib.crc32(case.id.encode())


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_forward_matches_reference_and_native(case, dtype):
    args, kwargs = build(case, dtype, seed=_seed(case), device="cuda")
    out, probs = sdpa_math.attention(*args, **kwargs)
    assert out.is_cuda and out.dtype == dtype and probs.dtype == dtype
    rtol, atol = TOL[dtype]
    scale_v = max(args[2].abs().max().item(), 1.0)
    ref_out, ref_probs = _reference(args, kwargs)
    torch.testing.assert_close(probs.cpu().double(), ref_probs, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=rtol, atol=atol * scale_v * 10)
    nat_out, nat_probs = native(args, kwargs, dtype)
    torch.testing.assert_close(probs.to(nat_probs.dtype), nat_probs, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.to(nat_out.dtype), nat_out, rtol=rtol, atol=atol * scale_v * 10)


def _grad_err(a, b, atol):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).norm() / (b.norm() + atol * b.numel() ** 0.5)).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_backward_matches_reference(case, dtype):
    """dQ, dK, dV (and a float mask's gradient) from random dO and dP, against float64."""
    args, kwargs = build(case, dtype, seed=_seed(case), device="cuda")
    q, k, v, mask, p, causal, dmask = args
    float_mask = mask is not None and mask.is_floating_point()

    def grads(q, k, v, mask, dmask):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        m = mask.detach().clone().requires_grad_(True) if float_mask else mask
        out, probs = sdpa_math.attention(*leaves, m, p, causal, dmask, **kwargs)
        gen = torch.Generator().manual_seed(_seed(case) + 1)
        g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out)
        g_probs = torch.randn(probs.shape, generator=gen, dtype=torch.float64).to(probs)
        wrt = leaves + ([m] if float_mask else [])
        return torch.autograd.grad((out, probs), wrt, (g_out, g_probs))

    got = grads(q, k, v, mask, dmask)
    ref = grads(*(_to_cpu64(t) for t in (q, k, v, mask, dmask)))
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), got, ref):
        # The looser of the inputs' dtype (the arithmetic) and the gradient's own (a mask's
        # gradient has the mask's dtype: fp32 for fmin_rows whatever the inputs).
        rtol, atol = max(GRAD_TOL[dtype], GRAD_TOL[a.dtype])
        assert torch.isfinite(a).all(), name
        assert _grad_err(a, b, atol) <= rtol, (name, _grad_err(a, b, atol))


GRADCHECK_CASES = [Case(batch=(1,), L=5, S=6, E=4, Ev=3),
                   Case(batch=(1,), L=5, S=6, E=4, Ev=3, mask="float"),
                   Case(batch=(1,), L=6, S=6, E=4, Ev=4, causal=True),
                   Case(batch=(1,), hq=4, hkv=2, gqa=True, L=4, S=5, E=4, Ev=4),
                   Case(batch=(1,), L=5, S=6, E=4, Ev=4, dropout="explicit_bool", mask="bool_rows"),
                   Case(batch=(1,), L=5, S=7, E=4, Ev=4, layout="transposed")]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=lambda c: c.id)
def test_gradcheck_float64_cuda_through_o_and_p(case):
    args, kwargs = build(case, torch.float64, seed=_seed(case), device="cuda")
    q, k, v, mask, p, causal, dmask = args
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    if mask is not None and mask.is_floating_point():
        leaves.append(mask.detach().clone().requires_grad_(True))

    def fn(q, k, v, *m):
        return sdpa_math.attention(q, k, v, m[0] if m else mask, p, causal, dmask, **kwargs)

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("L,S", [(37, 70), (2, 530)], ids=["tiles", "decode"])
def test_random_dropout_same_mask_on_cpu_and_cuda(dtype, L, S):
    args, kwargs = build(Case(hq=3, hkv=3, L=L, S=S, E=64, Ev=64), dtype, seed=5, device="cuda")
    q, k, v = args[:3]
    cuda = sdpa_math.attention_with_lse(q, k, v, None, 0.3, False, None, seed=987654321, offset=12)
    cpu = sdpa_math.attention_with_lse(q.cpu(), k.cpu(), v.cpu(), None, 0.3, False, None, seed=987654321, offset=12)
    dropped_cuda, dropped_cpu = cuda[1].cpu() == 0, cpu[1] == 0
    assert dropped_cpu.float().mean().item() > 0.2
    assert torch.equal(dropped_cuda, dropped_cpu)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(cuda[1].cpu().float(), cpu[1].float(), rtol=rtol, atol=atol)


def _decode_matches_reference(case, dtype):
    """The case on the GPU (outputs poisoned first) against the float64 reference; O's atol
    scaled by max|V| as in flash attention's rounding of the weights."""
    args, kwargs = build(case, dtype, seed=_seed(case), device="cuda")
    out, probs = sdpa_math.attention(*args, **kwargs)
    ref_out, ref_probs = _reference(args, kwargs)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs.cpu().double(), ref_probs, rtol=rtol, atol=atol)
    scale_v = max(args[2].abs().max().item(), 1.0)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=rtol, atol=atol * scale_v * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("Ev", [8, 40, 128, 256])
@pytest.mark.parametrize("mask", ["none", "neginf_rows", "float_pad"])
@pytest.mark.parametrize("S", [4796, 1500])
def test_decode_rows_over_many_key_blocks(dtype, Ev, mask, S):
    """The decode path's last step on rows of 4796 keys (decode_finalize: 19 key blocks whose
    shares of O are summed by 32, 4, 2 or 1 groups of threads for Ev 8, 40, 128, 256, two chunks
    of the row's P) and of 1500 keys (decode_finalize_rows: a warp a row, 6 blocks, 4 logits a
    lane per 128 keys, O's dimensions 4 or 8 a lane, for Ev 8 on two lanes only); a GQA group's
    two heads in one CTA (L = 2); a fully masked row (neginf_rows) and a padding mask; against the
    float64 reference, with every output poisoned first."""
    _decode_matches_reference(Case(batch=(2,), hq=4, hkv=2, L=2, S=S, E=64, Ev=Ev, mask=mask, gqa=True), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("L,S,Ev", [(1, 300, 128), (3, 300, 128), (1, 1100, 64), (3, 530, 40), (1, 101, 8)])
def test_decode_workspace_of_odd_row_and_block_counts(dtype, L, S, Ev):
    """One head (B = H = 1): an odd number of rows times key blocks, so the decode workspace's
    per-block statistics take an odd number of pairs; decode_finalize_rows reads the logits and
    the shares of O 16 bytes at a time and must find both aligned (the shares once came after the
    statistics, and were not, for these shapes). Tensor-core and CUDA-core first steps, a tail of
    the row past the last group of 4 keys (530, 101); against the float64 reference."""
    _decode_matches_reference(Case(batch=(1,), hq=1, hkv=1, L=L, S=S, E=Ev if Ev >= 64 else 64, Ev=Ev), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("layout", ["contig", "blhe", "wide_rows"])
@pytest.mark.parametrize("hq,L", [(2, 1), (4, 1), (4, 3)], ids=["mha1", "gqa1", "gqa3"])
def test_decode_key_rows_of_any_row_stride(dtype, layout, hq, L):
    """The decode forward's K and V rows at any row stride with unit column stride: packed rows,
    the (B, S, H, E) view and rows wider than E; one row per CTA (MHA), a GQA pair in one CTA,
    three rows; 777 keys (a last block of 9 keys, a last warp step part full), E 64, Ev 40."""
    _decode_matches_reference(Case(batch=(2,), hq=hq, hkv=2, L=L, S=777, E=64, Ev=40, gqa=hq != 2, layout=layout), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("layout", ["contig", "blhe", "wide_rows"])
@pytest.mark.parametrize("hq,L,S", [(2, 1, 2048), (2, 1, 777), (4, 1, 2048), (4, 1, 777), (8, 1, 4796), (4, 2, 1100),
                                     (2, 3, 530), (4, 1, 300)],
                         ids=["mha1_2048", "mha1_777", "gqa2_2048", "gqa2_777", "gqa4_4796", "gqa2x2_1100", "mha3_530",
                              "gqa2_300"])
def test_decode_on_tensor_cores(dtype, E, layout, hq, L, S):
    """decode_partial_tc (fp16/bf16, E = Ev = 64 or 128, no mask): one row a CTA (MHA decode), a
    GQA group of two or four heads, 2 x 2 rows, or three rows of one head in one CTA; 512-key
    blocks full (2048), ragged (777: a block of 265 keys, warps with no key; 530), many (4796:
    10 blocks), one block (300); packed rows, the (B, S, H, E) view and rows wider than E. P and
    O against the float64 reference."""
    _decode_matches_reference(Case(batch=(2,), hq=hq, hkv=2, L=L, S=S, E=E, Ev=E, gqa=hq != 2, layout=layout), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("q_layout", ["offset", "sliced"])
@pytest.mark.parametrize("hq,L", [(2, 1), (4, 2)], ids=["mha1", "gqa2x2"])
def test_decode_on_tensor_cores_takes_queries_of_any_layout(dtype, q_layout, hq, L):
    """decode_partial_tc reads Q's rows 16 bytes at a time where it can, else element by element:
    a query starting one element past a 16-byte boundary (offset) or with column stride 2
    (sliced), K and V packed; against the float64 reference."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, h, n, 128, generator=gen).to(dtype) for h, n in ((hq, L), (2, 1100), (2, 1100)))
    if q_layout == "offset":
        q_dev = torch.empty(q.numel() + 1, dtype=dtype, device="cuda")[1:].view(q.shape)
    else:
        q_dev = torch.empty(2, hq, L, 256, dtype=dtype, device="cuda")[..., ::2]
    q_dev.copy_(q)
    assert q_dev.data_ptr() % 16 != 0 or q_dev.stride(-1) != 1
    out, probs = sdpa_math.attention(q_dev, k.cuda(), v.cuda(), enable_gqa=hq != 2)
    ref_out, ref_probs = sdpa_math.attention(q.double(), k.double(), v.double(), enable_gqa=hq != 2)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(probs.cpu().double(), ref_probs, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=rtol, atol=atol * 10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=ids)
def test_decode_on_tensor_cores_keeps_nan_and_inf_rows(dtype):
    """A NaN in one key row makes the rows that see it NaN in P, O and lse, as the math op's
    softmax does; a +inf logit's row is NaN too (inf - inf), a -inf logit is a key of weight 0
    in an otherwise finite row; the other rows match the reference."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 2, 128, generator=gen).to(dtype)  # no mask, head 128: the tensor-core kernel
    k = torch.randn(2, 4, 1100, 128, generator=gen).to(dtype)
    v = torch.randn(2, 4, 1100, 128, generator=gen).to(dtype)
    k[0, 1, 700, 5] = float("nan")
    k[1, 2, 3, :] = 0  # key 3 of head (1, 2): logit +inf for row 0, -inf for row 1
    k[1, 2, 3, 5] = float("inf")
    q[1, 2, 0, 5], q[1, 2, 1, 5] = 1, -1
    out, probs, lse = sdpa_math.attention_with_lse(q.cuda(), k.cuda(), v.cuda(), None, 0.0, False, None)
    ref_out, ref_probs, ref_lse = sdpa_math.attention_with_lse(q.double(), k.double(), v.double(), None, 0.0, False, None)
    for got, ref in ((probs, ref_probs), (out, ref_out), (lse, ref_lse)):
        got = got.cpu().double()
        assert torch.equal(got.isnan(), ref.isnan())
        assert got.isnan().any()
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=rtol, atol=atol * 10)


def test_long_rows_past_2_pow_31_elements_per_batch_index_do_not_wrap():
    """P of (1, 2, 32768, 32768) fp16: the second head's P starts at element 2^31."""
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs 12 GB of free device memory")
    L = S = 32768
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 2, L, 64, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(1, 2, S, 64, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(1, 2, S, 64, device="cuda", dtype=torch.float16, generator=gen)
    out, probs = sdpa_math.attention(q, k, v)
    # Five rows: more than the decode path takes, so the same tile kernel recomputes them.
    rows = torch.tensor([0, 1, 12345, 20000, L - 1], device="cuda")
    for h in range(2):  # rows of each head recomputed on their own
        o_ref, p_ref = sdpa_math.attention(q[:, h:h + 1, rows], k[:, h:h + 1], v[:, h:h + 1])
        torch.testing.assert_close(probs[:, h:h + 1, rows], p_ref, rtol=0, atol=0)
        torch.testing.assert_close(out[:, h:h + 1, rows], o_ref, rtol=0, atol=0)


def test_grid_past_2_pow_31_blocks_is_refused_with_an_error():
    """The generic (float64) forward takes one block per query row: 2^31 + 8 rows need more blocks
    than a grid holds. The launcher refuses with an error naming the kernel; the count used to be
    cast to unsigned, which would wrap around to 8 blocks and leave the other rows unwritten. The
    query is one row expanded (no memory); the outputs the binding allocates take 51 GB."""
    free, _ = torch.cuda.mem_get_info()
    if free < 60 * 2**30:
        pytest.skip("needs 60 GB of free device memory")
    rows = 2**31 + 8
    q = torch.ones(1, 1, 1, 1, device="cuda", dtype=torch.float64).expand(1, 1, rows, 1)
    k = v = torch.ones(1, 1, 1, 1, device="cuda", dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"too many blocks for one launch of the generic forward kernel"):
        sdpa_math.attention(q, k, v)
    torch.cuda.empty_cache()
    out, probs = sdpa_math.attention(q[..., :3, :], k, v)  # the device still works
    assert torch.equal(probs.cpu(), torch.ones(1, 1, 3, 1, dtype=torch.float64))


def test_override_takes_cuda_calls_with_grad():
    args, kwargs = build(Case(hq=4, hkv=4, L=33, S=40, E=64, Ev=64, mask="float_pad"), torch.float16, seed=3,
                         device="cuda")
    q, k, v = (t.detach().requires_grad_(True) for t in args[:3])
    direct_out, direct_probs = sdpa_math.attention(q, k, v, args[3])
    before = sdpa_math.interceptions()
    with sdpa_math.override():
        out, probs = aten_math(q, k, v, args[3])
        (out.float().sum() + (probs.float() ** 2).sum()).backward()
    assert sdpa_math.interceptions() == before + 1
    assert torch.equal(out, direct_out) and torch.equal(probs, direct_probs)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_empty_dims_on_cuda():
    for shape_q, shape_k in [((0, 2, 5, 8), (0, 2, 6, 8)), ((1, 2, 0, 8), (1, 2, 6, 8)), ((1, 2, 5, 8), (1, 2, 0, 8))]:
        q = torch.randn(shape_q, device="cuda", dtype=torch.float16)
        k = torch.randn(shape_k, device="cuda", dtype=torch.float16)
        out, probs = sdpa_math.attention(q, k, k)
        nat_out, nat_probs = aten_math(q.float(), k.float(), k.float())
        assert out.shape == nat_out.shape and probs.shape == nat_probs.shape
        torch.testing.assert_close(out.float(), nat_out.nan_to_num(), rtol=0, atol=0, equal_nan=True)
