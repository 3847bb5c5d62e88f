"""kl_to's fused pieces (docs/statistics.md, "kl_to on CUDA"): torch.ops.sdpa_math.kl_rows against
its definition and kl_backward against float64 autograd (on the CPU both run the core's float64
reference; on CUDA the row kernel and the Hopper backward's KL form); on the CPU also the Python
helpers of the fused path (O's gradient by chunks, r K's reshaping); and attention_stats(kl_to=...)
through them on an sm_90 GPU: that it takes that path, its KL and gradients against float64 with O
in the same loss, heads weighted apart (the per-key-head scaling of dS in fp16), a reference with
mass on a causally hidden key (+inf), O and lse from PyTorch's fused kernels (cuDNN, flash,
efficient) or from our statistics kernel alike, a fresh autograd thread, and what it declines."""
import math
import threading

import pytest
import torch

import sdpa_math  # noqa: F401  (loads the ops)
from sdpa_math.stats import kl_cuda, logits as stats_logits, pytorch_fused
from sdpa_math.stats import attention_stats
from cuda_helpers import HALF_DTYPES, cuda_kernels, dtype_id, sm90_only

ops = torch.ops.sdpa_math
F64 = torch.float64


def kl_rows_want(r, causal, q, u, lse, scale):
    """The KL per row and R, in float64, straight from the definitions: Σ r log r (0 log 0 = 0)
    − scale q·u + R lse, 0 for a row with R = 0, +inf where causality hides a key r has mass on."""
    r = r.double()
    L, S = r.shape[-2:]
    xlogx = torch.where(r != 0, r * torch.log(torch.where(r != 0, r, torch.ones_like(r))), torch.zeros_like(r))
    hidden = torch.ones(L, S, dtype=torch.bool, device=r.device).triu(1) if causal else torch.zeros(L, S, dtype=torch.bool,
                                                                                                       device=r.device)
    R = r.sum(-1)
    kl = xlogx.sum(-1) - scale * (q.double() * u.double()).sum(-1) + R * lse.double()
    kl = torch.where(R != 0, kl, 0.0)  # no mass: 0, whatever q, u and the lse hold
    kl = torch.where(torch.where(hidden, r, 0.0).sum(-1) > 0, float("inf"), kl)
    return kl, R


def ref_map(shape, dtype, device, gen, causal=False, zeros=True):
    """A reference map: softmax rows with some exact zeros, top-left causal zeros when asked."""
    r = torch.softmax(torch.randn(shape, generator=gen, dtype=F64) * 2, -1)
    if zeros:
        r = torch.where(torch.rand(shape, generator=gen, dtype=F64) < 0.2, 0.0, r)
    if causal:
        L, S = shape[-2:]
        r = torch.where(torch.ones(L, S, dtype=torch.bool).tril(), r, 0.0)
    return r.to(device, dtype)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64], ids=dtype_id)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast", "odd_keys"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("u_layout", ["contiguous", "strided"])
def test_kl_rows_match_their_definitions(device, dtype, layout, causal, u_layout):
    """kl_rows for 4 dtypes and 4 layouts of r (16-byte row loads, strided rows, a map broadcast
    over heads, a key count past the 8-element loads), a query broadcast over batches, u
    contiguous (the CUDA kernel's direct loads: q in r's dtype, 40 elements, so some lanes take
    two) or strided (its per-element path); rows with R = 0 are 0 though their q is NaN and
    their lse ±inf or NaN; causal rows with mass right of the diagonal are +inf, the others
    finite."""
    gen = torch.Generator().manual_seed(3)
    S, E = (37 if layout == "odd_keys" else 64), 40
    r = ref_map((2, 3, 24, S), dtype, device, gen, causal=False)
    r[0, 0, :4] = 0.0  # rows with R = 0 (no lse term) ...
    r[0, 0, 2:4, 5] = 0.5  # ... and, under causality, rows 2 and 3 with mass on a hidden key
    if layout == "transposed":  # rows and heads swapped in memory: no 16-byte row loads
        r = r.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "broadcast":  # one map for every head
        r = r[:, :1].expand(2, 3, 24, S)
    stat = F64 if dtype == F64 else torch.float32
    q = torch.randn(1, 3, 24, E, generator=gen, dtype=F64).to(dtype)
    q[0, 0, :2, 3] = float("nan")  # on rows with R = 0 (in batch 0; q broadcasts over batches)
    q = q.to(device).expand(2, 3, 24, E)
    u = torch.randn(2, 3, 24, E, generator=gen, dtype=F64)
    u = (u if u_layout == "contiguous" else u.transpose(-2, -1).contiguous().transpose(-2, -1)).to(device, stat)
    lse = torch.randn(2, 3, 24, generator=gen, dtype=F64) + 3.0
    lse[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=F64)
    lse = lse.to(device, stat)
    kl, R = ops.kl_rows(r, causal, q, u, lse, 0.7)
    want_kl, want_R = kl_rows_want(r, causal, q, u, lse, 0.7)
    for name, got, w in (("kl", kl, want_kl), ("R", R, want_R)):
        assert got.dtype == stat and got.shape == r.shape[:-1], name
        torch.testing.assert_close(got.double(), w, rtol=2e-6 if stat == torch.float32 else 1e-12, atol=2e-5,
                                   equal_nan=True, msg=name)
    assert (kl[0, 0, :2] == 0).all()  # no mass: 0 despite the NaN q and the ±inf lse
    if not causal:
        assert torch.isnan(kl[1, 0, :2]).all()  # the same NaN q where r has mass
    assert torch.isinf(kl).any() == causal and torch.isfinite(kl[1, 1:]).all() != causal


def test_kl_rows_with_a_head_past_256():
    """E past the CUDA kernel's direct loads (8 elements a lane): its per-element path; on the CPU
    the reference."""
    gen = torch.Generator().manual_seed(59)
    for device in DEVICES:
        r = ref_map((2, 5, 16), torch.float16, device, gen)
        q = torch.randn(2, 5, 264, generator=gen).to(device, torch.float16)
        u = torch.randn(2, 5, 264, generator=gen).to(device)
        lse = torch.randn(2, 5, generator=gen).to(device)
        kl, R = ops.kl_rows(r, False, q, u, lse, 0.1)
        want_kl, want_R = kl_rows_want(r, False, q, u, lse, 0.1)
        torch.testing.assert_close(kl.double(), want_kl, rtol=2e-6, atol=2e-5)
        torch.testing.assert_close(R.double(), want_R, rtol=2e-6, atol=1e-6)


def kl_forward_want(q, k, r, lse, scale, causal, gqa, keep=None):
    """kl_forward's rows in float64 from its definition: Σ r log r − Σ_j r_ij x_ij over the keys
    row i sees + R lse (the lse as given), 0 for a row with R = 0, +inf where r has mass on a
    hidden key (causality, or keep = False in a bool mask)."""
    q, k, r, lse = (t.double().cpu() for t in (q, k, r, lse))
    kk = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) if gqa else k
    x = scale * q @ kk.transpose(-2, -1)
    L, S = x.shape[-2:]
    hidden = torch.ones(L, S, dtype=torch.bool).triu(1) if causal else torch.zeros(L, S, dtype=torch.bool)
    if keep is not None:
        hidden = hidden | ~keep.cpu()
    xlogx = torch.where(r != 0, r * torch.log(torch.where(r != 0, r, 1.0)), 0.0)
    R = r.sum(-1)
    kl = xlogx.sum(-1) - torch.where(hidden, 0.0, r * x).sum(-1) + R * lse
    kl = torch.where(R != 0, kl, 0.0)
    kl = torch.where(torch.where(hidden, r, 0.0).sum(-1) > 0, float("inf"), kl)
    return kl, R


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=dtype_id)
def test_kl_forward_on_the_cpu_is_the_float64_reference(causal, gqa, dtype):
    """kl_forward on the CPU runs the core's float64 reference: its definition to rounding, with
    GQA's key heads, rows with R = 0 (0 though their lse is NaN), mass on a causally hidden key
    (+inf), and the lse taken as given (not P's own: a wrong source of it shows)."""
    gen = torch.Generator().manual_seed(61)
    B, H, Hkv, L, S, E = 2, 4, 2 if gqa else 4, 9, 11, 8
    q, k, v = (torch.randn(B, h, n, E, generator=gen, dtype=F64).to(dtype) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    r = ref_map((B, H, L, S), dtype, "cpu", gen, causal=causal)
    r[0, 1, :2] = 0.0  # no mass
    r[1, 0, 3, 7] = 0.5  # row 3 cannot see key 7 under causality
    lse = torch.randn(B, H, L, generator=gen, dtype=F64).to(torch.float32) + 2.0
    lse[0, 1, 0] = float("nan")
    kl, R = ops.kl_forward(q, k, v, causal, 0.3, gqa, lse, r)
    want_kl, want_R = kl_forward_want(q, k, r, lse, 0.3, causal, gqa)
    stat = F64 if dtype == F64 else torch.float32
    assert kl.dtype == stat and R.dtype == stat and kl.shape == (B, H, L)
    tight = dtype == F64
    torch.testing.assert_close(kl.double(), want_kl, rtol=1e-10 if tight else 2e-6, atol=1e-10 if tight else 2e-5)
    torch.testing.assert_close(R.double(), want_R, rtol=1e-12 if tight else 1e-6, atol=1e-12 if tight else 1e-6)
    assert (kl[0, 1, :2] == 0).all()
    assert math.isinf(kl[1, 0, 3].item()) == causal and torch.isfinite(kl[1, 1]).all()


KL_FORWARD_CASES = {  # B, Hq, Hkv, L, S, E, causal, reference layout
    "mha_d128": (2, 4, 4, 256, 256, 128, False, "contiguous"),
    "causal_gqa_d64": (2, 8, 2, 200, 200, 64, True, "contiguous"),
    "tails_e40": (1, 3, 3, 100, 136, 40, False, "contiguous"),
    "causal_rect_e80": (1, 2, 2, 130, 392, 80, True, "contiguous"),  # key tiles no row sees
    "decode": (4, 4, 4, 1, 520, 128, False, "contiguous"),
    "ref_transposed": (2, 3, 3, 64, 128, 64, True, "transposed"),  # (B, L, H, S) memory
    "ref_broadcast": (2, 3, 3, 96, 64, 128, False, "broadcast"),  # one map for every head
}


@sm90_only
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(KL_FORWARD_CASES))
def test_kl_forward_kernel_matches_its_definition(case, dtype):
    """The Hopper kernel (Q Kᵀ on the tensor cores, the reference folded in per tile) within 1e-5
    of the float64 definition for head sizes 40 to 128, GQA, rows and keys past whole tiles,
    causal with L ≠ S, decode, and references transposed or broadcast over heads; rows with
    R = 0 are 0 though their lse is NaN, a row with mass on a hidden key +inf."""
    gen = torch.Generator().manual_seed(67)
    B, H, Hkv, L, S, E, causal, layout = KL_FORWARD_CASES[case]
    q, k, v = (torch.randn(B, h, n, E, generator=gen).to(dtype) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    r = ref_map((B, H, L, S), dtype, "cpu", gen, causal=causal)
    r[0, 0, :1] = 0.0
    inf_rows = []
    if causal:  # mass on a hidden key: in a diagonal tile, and in a tile past every row of a CTA
        inf_rows = [(L // 2, L // 2 + 1), (1, S - 1), (L - 1, S - 1)]
        inf_rows = [(i, j) for i, j in inf_rows if j > i]
        for i, j in inf_rows:
            r[B - 1, H - 1, i, j] = 0.25
    kk = k.double().repeat_interleave(H // Hkv, dim=1)
    x = q.double() @ kk.transpose(-2, -1) / math.sqrt(E)
    if causal:
        x = x.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(x, -1).float()
    lse[0, 0, 0] = float("nan")
    rc = r.cuda()
    if layout == "transposed":
        rc = rc.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "broadcast":
        rc = r[:, :1].cuda().expand(B, H, L, S)  # stride 0 over heads on the GPU
        r = r[:, :1].expand(B, H, L, S)
    args = (q.cuda(), k.cuda(), v.cuda(), causal, None, Hkv != H, lse.cuda(), rc)
    assert ops.kl_forward_has_kernel(*args)
    (kl, R), kernels = cuda_kernels(lambda: ops.kl_forward(*args))
    assert any("kl_forward_sm90" in n for n in kernels), kernels
    want_kl, want_R = kl_forward_want(q, k, r, lse, 1 / math.sqrt(E), causal, Hkv != H)
    torch.testing.assert_close(kl.double().cpu(), want_kl, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(R.double().cpu(), want_R, rtol=1e-5, atol=1e-6)
    assert kl[0, 0, 0] == 0
    for i, _ in inf_rows:
        assert math.isinf(kl[B - 1, H - 1, i].item()), i
    assert torch.isfinite(kl[B - 1, 0]).all()


@sm90_only
def test_kl_forward_declines_what_the_tma_unit_cannot_read():
    """S = 36: rows of 72 bytes, not 16-byte aligned. kl_forward_has_kernel says no and the op
    raises naming why; kl_to then takes r K and kl_rows though it has 128 query rows. fp32 inputs
    are declined too."""
    gen = torch.Generator().manual_seed(71)
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen).cuda().half() for n in (128, 36, 36))
    r = ref_map((1, 2, 128, 36), torch.float16, "cuda", gen)
    lse = torch.zeros(1, 2, 128, device="cuda")
    assert not ops.kl_forward_has_kernel(q.float(), k.float(), v.float(), False, None, False, lse, r.float())
    assert not ops.kl_forward_has_kernel(q, k, v, False, None, False, lse, r)
    with pytest.raises(RuntimeError, match="kl_forward: no CUDA kernel takes this problem, the TMA unit cannot address"):
        ops.kl_forward(q, k, v, False, None, False, lse, r)
    (_, st), kernels = cuda_kernels(lambda: attention_stats(q, k, v, kl_to=r))
    assert any("kl_rows_kernel" in n for n in kernels) and not any("kl_forward_sm90" in n for n in kernels), kernels


def kl_backward_want(q, k, r, R, g, scale, causal, gqa):
    """dQ and dK of Σ g_i Σ_j r_ij log(r_ij / P_ij) with R given (the op's definition: dS = g (R P − r))
    by float64 autograd through P."""
    q, k = (t.detach().double().requires_grad_() for t in (q, k))
    kk = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) if gqa else k
    x = scale * q @ kk.transpose(-2, -1)
    if causal:
        L, S = x.shape[-2:]
        x = x.masked_fill(torch.ones(L, S, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    # Σ_i g_i (R_i lse_i − Σ_j r_ij x_ij): its gradient to x is g (R P − r), the op's definition
    # (r is 0 wherever x is −inf)
    rx = torch.where(r > 0, r.double() * x, 0.0).sum(-1)
    loss = (g.double() * (R.double() * torch.logsumexp(x, -1) - rx)).sum()
    return torch.autograd.grad(loss, (q, k))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_kl_backward_on_the_cpu_is_the_float64_reference(causal, gqa):
    """The CPU op runs the core's float64 reference: it matches autograd through P to rounding,
    for an R that is not Σ r (the op takes R as given) and with GQA's sum over a group."""
    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, L, S, E = 2, 4, 2 if gqa else 4, 9, 11, 8
    q, k, v = (torch.randn(B, h, n, E, generator=gen, dtype=F64) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    r = ref_map((B, H, L, S), F64, "cpu", gen, causal=causal)
    R = r.sum(-1) * 1.25
    g = torch.randn(B, H, L, generator=gen, dtype=F64)
    scale = 0.3
    _, _, lse = ops.forward(q, k, v, None, 0.0, causal, None, scale, gqa, None)
    dq, dk = ops.kl_backward(q, k, v, causal, scale, gqa, lse, r, R, g, [True, True])
    want_q, want_k = kl_backward_want(q, k, r, R, g, scale, causal, gqa)
    torch.testing.assert_close(dq, want_q, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dk, want_k, rtol=1e-10, atol=1e-12)
    dq_only, empty = ops.kl_backward(q, k, v, causal, scale, gqa, lse, r, R, g, [True, False])
    assert empty.numel() == 0 and torch.equal(dq_only, dq)


def test_kl_backward_names_bad_inputs():
    q = torch.randn(1, 2, 4, 8, dtype=F64)
    lse = torch.zeros(1, 2, 4, dtype=torch.float32)
    r = torch.rand(1, 2, 4, 5, dtype=F64)
    with pytest.raises(RuntimeError, match=r"reference has shape \(1, 2, 4, 5\), expected \(1, 2, 4, 4\)"):
        ops.kl_backward(q, q, q, False, None, False, lse, r, lse, lse, [True, True])
    with pytest.raises(RuntimeError, match="grad_kl has shape"):
        ops.kl_backward(q, q, q, False, None, False, lse, r[..., :4], lse, lse[..., :3], [True, True])
    with pytest.raises(RuntimeError, match=r"reference has shape \(1, 2, 4, 5\), expected \(1, 2, 4, 4\)"):
        ops.kl_forward(q, q, q, False, None, False, lse, r)
    with pytest.raises(RuntimeError, match=r"logsumexp has shape \(1, 2, 3\), expected \(1, 2, 4\)"):
        ops.kl_forward(q, q, q, False, None, False, lse[..., :3], r[..., :4])
    with pytest.raises(RuntimeError, match="reference must have at least 2 dims"):
        ops.kl_rows(torch.rand(5), False, q, q, lse, 1.0)
    with pytest.raises(RuntimeError, match=r"ref_keys has shape \(1, 2, 4, 7\), expected \(1, 2, 4, 8\)"):
        ops.kl_rows(r[..., :4], False, q, torch.zeros(1, 2, 4, 7), lse, 1.0)
    with pytest.raises(RuntimeError, match="ref_keys has dtype bfloat16, expected float32 or float64"):
        ops.kl_rows(r[..., :4], False, q, q.bfloat16(), lse, 1.0)
    with pytest.raises(RuntimeError, match=r"logsumexp has shape \(1, 2, 3\), expected \(1, 2, 4\)"):
        ops.kl_rows(r[..., :4], False, q, q, lse[..., :3], 1.0)


@pytest.mark.parametrize("case", ["causal_gqa", "broadcast_q"])
def test_o_gradient_by_chunks_equals_the_whole_backward(case):
    """_KLFused's gradient through O (when the loss uses O too) runs the operator's backward a
    chunk of query rows at a time, so its backward never holds the whole P: equal, to rounding,
    to one backward over all rows (float64 on the CPU; 4-row chunks, a causal chunk with its rows
    of the top-left mask)."""
    gen = torch.Generator().manual_seed(41)
    if case == "causal_gqa":
        qs, ks, causal, gqa = (2, 4, 11, 8), (2, 2, 13, 8), True, True
    else:
        qs, ks, causal, gqa = (4, 11, 8), (2, 4, 13, 8), False, False
    q, k, v = (torch.randn(s, generator=gen, dtype=F64) for s in (qs, ks, ks))
    o, p, lse = ops.forward(q, k, v, None, 0.0, causal, None, None, gqa, None)
    d_o = torch.randn(o.shape, generator=gen, dtype=F64)
    want = ops.backward(d_o, None, q, k, v, None, lse, o, p, 0.0, causal, None, None, gqa, None, [True] * 3 + [False])
    got = kl_cuda._o_grads_by_chunks(q, k, v, o, lse, d_o, causal, None, gqa, (True, True, True), chunk_rows=4)
    for name, g, w in zip(("dq", "dk", "dv"), got, want[:3]):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)
    only_k = kl_cuda._o_grads_by_chunks(q, k, v, o, lse, d_o, causal, None, gqa, (False, True, False), chunk_rows=4)
    assert only_k[0] is None and only_k[2] is None
    torch.testing.assert_close(only_k[1], want[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gqa", [False, True])
def test_ref_keys_give_the_sum_of_r_times_the_logits(gqa, monkeypatch):
    """_KLFused's Σ_j r_ij x_ij as scale · q_i · (r K)_i, a GQA group's rows stacked against its
    key head: kl_rows with _ref_keys' u gives the KL computed over the L×S logits. The product
    (bmm with fp32 results) exists only on CUDA; here a float64 product stands in for it, so the
    reshaping and the grouping are what is checked."""
    monkeypatch.setattr(stats_logits, "_bmm_fp32", lambda a, b: a.double() @ b.double())
    gen = torch.Generator().manual_seed(47)
    B, H, Hkv, L, S, E = 2, 4, 2 if gqa else 4, 5, 7, 8
    q = torch.randn(B, H, L, E, generator=gen, dtype=F64)
    k = torch.randn(B, Hkv, S, E, generator=gen, dtype=F64)
    r = torch.rand(B, H, L, S, generator=gen, dtype=F64)
    kk = k.repeat_interleave(H // Hkv, dim=1)
    x = (q @ kk.transpose(-2, -1)) * 0.5
    lse = torch.logsumexp(x, -1)
    want = (r * (torch.log(r) - (x - lse[..., None]))).sum(-1)
    u = kl_cuda._ref_keys(r, k, gqa)
    assert u.shape == (B, H, L, E)
    kl, _ = ops.kl_rows(r, False, q, u, lse, 0.5)
    torch.testing.assert_close(kl, want, rtol=1e-12, atol=1e-12)
    assert kl_cuda._ref_product_view(r, k, gqa) is not None
    assert kl_cuda._ref_product_view(r[:, :1].expand(B, H, L, S), k, gqa) is None  # would copy r
    assert kl_cuda._ref_product_view(r.transpose(1, 2).contiguous().transpose(1, 2), k, gqa) is None


# --- attention_stats(kl_to=...) through the CUDA kernels -----------------------------------------

def kl_and_grads(q, k, v, r, kw, wo=None, g_kl=None):
    """(KL, dq, dk, dv) of Σ g KL (+ Σ wo O) through attention_stats, or in float64 through full P."""
    out, st = attention_stats(q, k, v, kl_to=r, **kw)
    kl = st["kl_to"]
    loss = (kl.double() * g_kl).sum() if g_kl is not None else kl.double().sum()
    if wo is not None:
        loss = loss + (wo.double() * out.double()).sum()
    return [kl] + list(torch.autograd.grad(loss, (q, k, v)))


def leaves(ts, device, dtype):
    return [t.detach().to(device, dtype).requires_grad_(True) for t in ts]


FUSED_CASES = {  # B, Hq, Hkv, L, S, E, causal
    "mha": (2, 4, 4, 128, 256, 64, False),
    "tails": (1, 3, 3, 100, 136, 128, False),  # L and S past whole tiles
    "causal_gqa": (2, 8, 2, 192, 192, 128, True),
    "causal_l_lt_s": (1, 4, 4, 70, 200, 64, True),
    "decode": (4, 8, 8, 1, 512, 128, False),
    "head80": (1, 2, 2, 64, 128, 80, False),
    "odd_rows": (2, 4, 2, 70, 90, 64, True),  # 180-byte rows of r: loaded in pairs, not by TMA
}


def rel_err(got, want):
    return ((got.double().cpu() - want).norm() / want.norm().clamp(min=1e-30)).item()


def math_op_grads(q, k, v, r, causal, gqa, wo):
    """What a user runs today: the math op's P, the KL written by hand in fp32, autograd."""
    o, p = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=causal, enable_gqa=gqa)
    rf = r.float()
    logp = torch.log(torch.where(rf > 0, p.float(), 1.0))  # not log 0 where causality hides a key (r = 0 there)
    kl = (torch.where(rf > 0, rf * (torch.log(torch.where(rf > 0, rf, 1.0)) - logp), 0.0)).sum(-1)
    return torch.autograd.grad(kl.sum() + (wo * o.float()).sum(), (q, k, v))


@sm90_only
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_kl_to_takes_the_fused_kernels_and_matches_float64(case, dtype):
    """The KL within 1e-5 of float64 (issue 16's target, measured as the statistics kernel's are);
    dQ, dK and dV (O in the loss) no further from float64 than the math op's P with the KL
    written by hand, times 1.1, or within 2e-3 (fp16) / 1.6e-2 (bf16) in norm."""
    gen = torch.Generator().manual_seed(17)
    B, H, Hkv, L, S, E, causal = FUSED_CASES[case]
    # inputs rounded to the dtype first: the float64 side sees the same numbers
    q, k, v = (torch.randn(B, h, n, E, generator=gen).to(dtype) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    r = ref_map((B, H, L, S), dtype, "cpu", gen, causal=causal)
    kw = dict(is_causal=causal, enable_gqa=Hkv != H)
    wo = torch.randn(B, H, L, E, generator=gen)
    lq, lk, lv = leaves((q, k, v), "cuda", dtype)
    route = kl_cuda._kl_fused_applies(lq, lk, lv, None, r.cuda(), causal, None, Hkv != H, (B, H))
    # the forward's rows: the Hopper kernel where TMA reads the reference (16-byte rows) and there are
    # enough query rows, else r K and kl_rows
    assert route == ("kl_forward" if S % 8 == 0 and L >= kl_cuda._KL_FORWARD_MIN_ROWS else "r_k"), route
    got, kernels = cuda_kernels(lambda: kl_and_grads(lq, lk, lv, r.cuda(), kw, wo=wo.cuda()))
    assert any("backward_sm90<" in n and "false, true>" in n for n in kernels), kernels  # the KL form ran
    ran, skipped = ("kl_forward_sm90", "kl_rows_kernel") if route == "kl_forward" else ("kl_rows_kernel", "kl_forward_sm90")
    assert any(ran in n for n in kernels) and not any(skipped in n for n in kernels), kernels
    want = kl_and_grads(*leaves((q, k, v), "cpu", F64), r.double(), kw, wo=wo)
    assert rel_err(got[0], want[0]) <= 1e-5, rel_err(got[0], want[0])
    torch.testing.assert_close(got[0].double().cpu(), want[0], rtol=1e-5, atol=1e-5)
    native = math_op_grads(*leaves((q, k, v), "cuda", dtype), r.cuda(), causal, Hkv != H, wo.cuda())
    floor = 2e-3 if dtype == torch.float16 else 1.6e-2
    for name, g, n, w in zip(("dq", "dk", "dv"), got[1:], native, want[1:]):
        assert torch.isfinite(g).all(), name
        ours, theirs = rel_err(g, w), rel_err(n, w)
        assert ours <= max(1.1 * theirs, floor), (name, ours, theirs)


@sm90_only
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_kl_to_fused_gradient_with_rows_weighted_apart(dtype):
    """Query heads weighted 1e-2 and one weighted 1e3, with GQA: in fp16 each key head's dS is
    scaled by its own power of two (2^14 over its group's largest |g| R) and dK and dQ divide it
    out again; a factor undone for the wrong head (or a lead index mapped to the wrong key head)
    puts that head's gradients off by powers of two. Each head's gradients within the bound of a
    unit loss, against its own norm. (Weights small enough to put dS among fp16's subnormals
    make dQ and dK subnormal too, at these sizes: the outputs' dtype, not dS, then limits.)"""
    gen = torch.Generator().manual_seed(23)
    B, H, Hkv, L, S, E = 2, 4, 2, 128, 128, 64
    q, k, v = (torch.randn(B, h, n, E, generator=gen).to(dtype) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    r = ref_map((B, H, L, S), dtype, "cpu", gen)
    g = torch.full((B, H, L), 1e-2, dtype=F64)
    g[1, 3] = 1e3
    kw = dict(enable_gqa=True)
    got = kl_and_grads(*leaves((q, k, v), "cuda", dtype), r.cuda(), kw, g_kl=g.cuda())
    want = kl_and_grads(*leaves((q, k, v), "cpu", F64), r.double(), kw, g_kl=g)
    bound = 2e-3 if dtype == torch.float16 else 1.6e-2
    for b in range(B):
        for h in range(H):
            assert rel_err(got[1][b, h], want[1][b, h]) <= bound, ("dq", b, h, rel_err(got[1][b, h], want[1][b, h]))
        for h in range(Hkv):
            assert rel_err(got[2][b, h], want[2][b, h]) <= bound, ("dk", b, h, rel_err(got[2][b, h], want[2][b, h]))


@sm90_only
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"])
@pytest.mark.parametrize("case", ["causal_gqa", "mha", "tails"])
def test_kl_to_takes_o_and_lse_from_pytorchs_fused_kernels_or_ours_alike(case, backend):
    """_o_and_lse: O and lse from the fused kernel PyTorch's SDPA would choose among the enabled
    backends (here one at a time), or, where it chooses none (MATH only, or the backend declines
    the case), from our statistics kernel: the same O to fp16 rounding, the same KL within 1e-5
    and the same gradients either way (tails: L = 100, which the efficient kernel's lse pads to
    128). Causal with L ≠ S never goes to PyTorch's kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator().manual_seed(53)
    B, H, Hkv, L, S, E, causal = FUSED_CASES[case]
    q, k, v = (torch.randn(B, h, n, E, generator=gen).cuda().half().requires_grad_() for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    r = ref_map((B, H, L, S), torch.float16, "cuda", gen, causal=causal)
    kw = dict(is_causal=causal, enable_gqa=Hkv != H)

    def run():
        (o, st), kernels = cuda_kernels(lambda: attention_stats(q, k, v, kl_to=r, **kw))
        grads = torch.autograd.grad(st["kl_to"].sum() + o.float().sum(), (q, k, v))
        return o, st["kl_to"], grads, kernels

    with sdpa_kernel([getattr(SDPBackend, backend)]):
        with torch.no_grad():  # as _KLFused.forward asks (PyTorch's rules may depend on grad mode)
            choice = pytorch_fused._pytorch_fused_choice(q, k, v, causal, None, Hkv != H)
        assert pytorch_fused._pytorch_fused_choice(q[:, :, :L // 2], k, v, True, None, Hkv != H) == 0
        o_t, kl_t, g_t, kernels_t = run()
    with sdpa_kernel([SDPBackend.MATH]):  # no fused kernel: our statistics kernel gives O and lse
        assert pytorch_fused._pytorch_fused_choice(q, k, v, causal, None, Hkv != H) == 0
        o_s, kl_s, g_s, kernels_s = run()
    assert any("::forward_sm90<" in n for n in kernels_s), kernels_s
    took_theirs = not any("::forward_sm90<" in n for n in kernels_t)
    assert took_theirs == (choice != 0), (choice, kernels_t)
    if backend == "FLASH_ATTENTION" and case == "mha":  # flash takes it on any sm_80+ GPU
        assert choice == 1
    torch.testing.assert_close(o_t, o_s, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(kl_t, kl_s, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), g_t, g_s):
        assert rel_err(a, b.double().cpu()) <= 2e-3, (name, rel_err(a, b.double().cpu()))


@sm90_only
def test_kl_to_fused_is_inf_where_the_reference_has_mass_on_a_hidden_key():
    gen = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen).cuda().half() for _ in range(3))
    r = ref_map((1, 2, 64, 64), torch.float16, "cuda", gen, causal=True)
    r[0, 1, 5, 40] = 0.25  # row 5 cannot see key 40
    _, st = attention_stats(q, k, v, is_causal=True, kl_to=r)
    kl = st["kl_to"]
    assert math.isinf(kl[0, 1, 5].item()) and kl[0, 1, 5] > 0
    assert torch.isfinite(kl[0, 0]).all() and torch.isfinite(kl[0, 1, :5]).all()


@sm90_only
def test_kl_to_with_a_mask_or_a_float32_reference_keeps_the_composition():
    """What the fused path declines (a mask; a reference in another dtype) still runs, elsewhere."""
    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen).cuda().half() for _ in range(3))
    r = ref_map((1, 2, 64, 64), torch.float32, "cuda", gen)
    mask = torch.zeros(64, 64, device="cuda", dtype=torch.half)
    assert not kl_cuda._kl_fused_applies(q, k, v, mask, r.half(), False, None, False, (1, 2))
    assert not kl_cuda._kl_fused_applies(q, k, v, None, r, False, None, False, (1, 2))
    # Two batches of a (B, L, H, S) layout: with 128 query rows kl_forward's kernel reads it through
    # TMA. With 64 rows the older route would run, whose r K would copy it to P's size, so the
    # chunks take it; contiguous, its lead dims merge into one batch dim that bmm reads as is.
    # With S = 34 (rows 136 bytes apart) TMA cannot read it, whatever the row count.
    def blhs(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def applies(L, S, r_layout):
        q2, k2, v2 = (torch.randn(2, 2, n, 64, generator=gen).cuda().half() for n in (L, S, S))
        r2 = r_layout(ref_map((2, 2, L, S), torch.float16, "cuda", gen))
        return kl_cuda._kl_fused_applies(q2, k2, v2, None, r2, False, None, False, (2, 2))

    assert applies(128, 64, blhs) and not applies(64, 64, blhs) and applies(64, 64, lambda t: t)
    assert not applies(128, 34, blhs) and applies(128, 34, lambda t: t)
    assert kl_cuda._kl_fused_applies(q, k, v, None, r.half(), False, None, False, (1, 2))
    _, kernels = cuda_kernels(lambda: attention_stats(q, k, v, kl_to=r))
    assert not any("backward_sm90" in n for n in kernels)


@sm90_only
def test_kl_to_under_deterministic_algorithms_keeps_the_chunks():
    """The KL form adds dQ with float atomics: with a gradient under
    torch.use_deterministic_algorithms(True), kl_to takes the chunks (deterministic products),
    not an error from the fused backward; without a gradient the fused path stays."""
    gen = torch.Generator().manual_seed(43)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=gen).cuda().half().requires_grad_() for _ in range(3))
    r = ref_map((1, 2, 64, 64), torch.float16, "cuda", gen)
    # warn_only: cuBLAS's products would otherwise need CUBLAS_WORKSPACE_CONFIG set before start
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not kl_cuda._kl_fused_applies(q, k, v, None, r, False, None, False, (1, 2))
        with torch.no_grad():
            assert kl_cuda._kl_fused_applies(q, k, v, None, r, False, None, False, (1, 2))
        _, st = attention_stats(q, k, v, kl_to=r)
        dq, dk = torch.autograd.grad(st["kl_to"].sum(), (q, k))
        assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    finally:
        torch.use_deterministic_algorithms(False)


@sm90_only
def test_kl_backward_runs_its_kernel_from_a_fresh_thread():
    """Autograd runs a CUDA backward on its own device thread. When our op is the first that thread
    runs, no CUDA context is bound to it yet, and the driver's tensor-map encoding failed there
    (kl_to's backward raised in a fresh process). The op now binds the device's context
    itself; a thread that has made no CUDA call gets the same gradients as the main thread."""
    gen = torch.Generator().manual_seed(37)
    q, k, v = (torch.randn(2, 4, 128, 64, generator=gen).cuda().half() for _ in range(3))
    r = ref_map((2, 4, 128, 128), torch.float16, "cuda", gen)
    _, _, lse = ops.forward(q, k, v, None, 0.0, False, None, None, False, None)
    R = r.float().sum(-1)
    g = torch.rand(2, 4, 128, generator=gen).cuda()
    args = (q, k, v, False, None, False, lse, r, R, g, [True, True])
    result = {}

    def fresh():
        try:
            result["grads"] = ops.kl_backward(*args)
            torch.cuda.synchronize()
        except Exception as e:  # reported below, on the test's thread
            result["error"] = e

    thread = threading.Thread(target=fresh)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    for got, want in zip(result["grads"], ops.kl_backward(*args)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-4)  # dQ's reductions may add in another order
