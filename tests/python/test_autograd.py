"""Autograd through O and P: float64 gradcheck, and random dropout's reproducibility."""
import pytest
import torch

import sdpa_math

torch.manual_seed(0)


def _inputs(B=1, Hq=2, Hkv=2, L=4, S=5, E=3, Ev=2, transposed=False):
    def t(*shape):
        x = torch.randn(*shape, dtype=torch.float64)
        if transposed:
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
        return x.requires_grad_(True)
    return t(B, Hq, L, E), t(B, Hkv, S, E), t(B, Hkv, S, Ev)


GRADCHECKS = {
    "plain_O_and_P": dict(),
    "dP_only": dict(only_probs=True),
    "dO_only": dict(only_output=True),
    "float_mask_requires_grad": dict(mask="float"),
    "float_mask_broadcast_requires_grad": dict(mask="float_pad"),
    "bool_mask_fully_masked_row": dict(mask="bool_rows"),
    "causal": dict(causal=True),
    "gqa": dict(Hq=4, Hkv=2, gqa=True),
    "explicit_dropout": dict(dropout="explicit"),
    "random_dropout_fixed_stream": dict(dropout="random"),
    "noncontiguous": dict(transposed=True),
}


@pytest.mark.parametrize("name", list(GRADCHECKS))
def test_gradcheck(name):
    cfg = dict(GRADCHECKS[name])
    only_probs, only_output = cfg.pop("only_probs", False), cfg.pop("only_output", False)
    mask_kind, causal, gqa, dropout = cfg.pop("mask", None), cfg.pop("causal", False), cfg.pop("gqa", False), cfg.pop("dropout", None)
    q, k, v = _inputs(**cfg)
    L, S = q.shape[-2], k.shape[-2]
    inputs = [q, k, v]
    mask = None
    if mask_kind == "float":
        mask = torch.randn(1, q.shape[1], L, S, dtype=torch.float64, requires_grad=True)
    elif mask_kind == "float_pad":
        mask = torch.randn(1, 1, 1, S, dtype=torch.float64, requires_grad=True)
    elif mask_kind == "bool_rows":
        mask = torch.rand(L, S) < 0.7
        mask[1] = False
    if mask is not None and mask.requires_grad:
        inputs.append(mask)
    dmask = torch.rand(1, q.shape[1], L, S) < 0.7 if dropout == "explicit" else None
    p = 0.3 if dropout else 0.0

    def fn(q, k, v, *m):
        m = m[0] if m else mask
        out, probs, _ = sdpa_math.attention_with_lse(q, k, v, m, p, causal, dmask, enable_gqa=gqa, seed=123, offset=4)
        if only_probs:
            return probs
        if only_output:
            return out
        return out, probs

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_random_dropout_reproducible_under_manual_seed():
    q, k, v = _inputs(L=16, S=24, E=8, Ev=8)
    torch.manual_seed(7)
    o1, p1 = sdpa_math.attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(7)
    o2, p2 = sdpa_math.attention(q, k, v, dropout_p=0.4)
    o3, p3 = sdpa_math.attention(q, k, v, dropout_p=0.4)  # the generator moved on
    assert torch.equal(p1, p2) and torch.equal(o1, o2)
    assert not torch.equal(p1, p3)
    kept = (p1 != 0).double().mean().item()
    assert 0.45 < kept < 0.75  # 768 draws at keep 0.6


def test_random_dropout_backward_uses_the_forward_mask():
    """Random dropout: O = c (A*M) V. The same O comes from an explicit mask M (recovered from P)
    with the same p, so the gradients of sum(O * g) must agree: backward replayed the mask."""
    q, k, v = _inputs(L=16, S=24, E=8, Ev=8)
    g = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    torch.manual_seed(3)
    out, probs = sdpa_math.attention(q, k, v, dropout_p=0.4)
    grads_random = torch.autograd.grad((out * g).sum(), (q, k, v))
    keep = probs.detach() != 0
    out2, _ = sdpa_math.attention(q, k, v, dropout_p=0.4, dropout_mask=keep)
    grads_explicit = torch.autograd.grad((out2 * g).sum(), (q, k, v))
    torch.testing.assert_close(out, out2)
    for a, b in zip(grads_random, grads_explicit):
        torch.testing.assert_close(a, b)


def test_no_grad_and_inference_mode_save_nothing():
    q, k, v = _inputs()
    with torch.no_grad():
        out, probs = sdpa_math.attention(q, k, v)
    assert out.grad_fn is None and probs.grad_fn is None
    with torch.inference_mode():
        out, probs = sdpa_math.attention(q, k, v)
    assert out.grad_fn is None and not out.requires_grad
    out, probs = sdpa_math.attention(q, k, v)
    assert out.grad_fn is not None and probs.grad_fn is not None


def test_backward_of_rows_near_finfo_min_matches_float64():
    """A row masked entirely with finfo.min has uniform P = 1/S; exp(s - lse) would give 1 there
    (lse rounds to the max), so backward must not rebuild A from lse."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64) for n in (9, 13, 13))
    mask = torch.randn(9, 13, generator=gen, dtype=torch.float64)
    mask[::3] = torch.finfo(torch.float32).min
    g_out, g_probs = torch.randn(1, 2, 9, 16, generator=gen), torch.randn(1, 2, 9, 13, generator=gen)

    def grads(dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        out, probs = sdpa_math.attention(*leaves, mask.to(dtype))
        return torch.autograd.grad((out, probs), leaves, (g_out.to(dtype), g_probs.to(dtype)))

    for got, ref in zip(grads(torch.float32), grads(torch.float64)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5


def _double_backward_inputs():
    q, k, v = _inputs()
    out, probs = sdpa_math.attention(q, k, v)
    return (q, k, v), (out * out).sum() + (probs * probs).sum()


def test_double_backward_raises_instead_of_silent_zeros():
    """create_graph=True works; differentiating the gradients raises (it gave None, only a warning)."""
    (q, k, v), loss = _double_backward_inputs()
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v), create_graph=True)
    first = torch.autograd.grad(loss, (q, k, v), retain_graph=True)
    for g, f in zip((gq, gk, gv), first):
        torch.testing.assert_close(g.detach(), f, rtol=0, atol=0)
    assert gq.requires_grad
    with pytest.raises(RuntimeError, match="sdpa_math: double backward is not supported"):
        torch.autograd.grad((gq.sum() + gk.sum() + gv.sum()), (q, k, v), allow_unused=True)


def test_gradgradcheck_raises():
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="sdpa_math: double backward is not supported"):
        torch.autograd.gradgradcheck(lambda q, k, v: sdpa_math.attention(q, k, v), (q, k, v))


def test_create_graph_without_second_derivative_through_attention():
    """The error comes when a second derivative reaches the op's gradients, not at create_graph=True:
    a second derivative through another branch of the same graph still works."""
    (q, k, v), loss = _double_backward_inputs()
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    gq, gx = torch.autograd.grad(loss + (x ** 3).sum(), (q, x), create_graph=True)
    hx, = torch.autograd.grad(gx.sum(), (x,))
    torch.testing.assert_close(hx, 6 * x.detach())


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test (warn_only through the returned setter)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    yield lambda warn_only: torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.set_num_threads(threads)


def _grads(device, hq, hkv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, 37, 16, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(2, hkv, 53, 16, generator=gen).to(device).requires_grad_() for _ in range(2))
    out, probs = sdpa_math.attention(q, k, v, None, 0.0, False, enable_gqa=hq != hkv)
    g_out = torch.randn(out.shape, generator=gen).to(device)
    g_probs = torch.randn(probs.shape, generator=gen).to(device)
    return torch.autograd.grad((out, probs), (q, k, v), (g_out, g_probs))


def test_deterministic_mode_cpu_backward_is_bitwise_reproducible(deterministic):
    torch.set_num_threads(2)
    first, second = _grads("cpu", 4, 4), _grads("cpu", 4, 4)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_deterministic_mode_refuses_cpu_gqa_sums_in_thread_order(deterministic):
    # K and V rows shared by two query heads: their dK, dV are added by threads as they finish.
    torch.set_num_threads(2)
    with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        _grads("cpu", 4, 2)
    deterministic(True)  # warn_only: PyTorch's warning, and the gradients
    with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
        grads = _grads("cpu", 4, 2)
    assert all(torch.isfinite(g).all() for g in grads)
    torch.set_num_threads(1)  # one thread adds in a fixed order: allowed, and reproducible
    deterministic(False)
    first, second = _grads("cpu", 4, 2), _grads("cpu", 4, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_mode_refuses_cuda_backward(deterministic):
    with pytest.raises(RuntimeError, match="sdpa_math::backward on CUDA does not have a deterministic"):
        _grads("cuda", 4, 4)
    deterministic(True)
    with pytest.warns(UserWarning, match="does not have a deterministic implementation"):
        _grads("cuda", 4, 4)


FIRST_CALL_COMPILED = r"""
import torch, sdpa_math
def step(q, k, v):
    out, probs = sdpa_math.attention(q, k, v)
    return out, probs
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
out, probs = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
compiled = torch.autograd.grad(out.sum() + probs.square().sum(), (q, k, v))
out, probs = sdpa_math.attention(q, k, v)
eager = torch.autograd.grad(out.sum() + probs.square().sum(), (q, k, v))
print("max diff", max(float((a - b).abs().max()) for a, b in zip(compiled, eager)))
"""


def test_first_call_under_compile_then_eager():
    """The autograd layer's placeholder for absent tensors is made at the first call; when that
    call is traced by torch.compile it must still be a real tensor, or later eager calls break."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", FIRST_CALL_COMPILED], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert float(run.stdout.split("max diff")[1]) < 1e-12, run.stdout
