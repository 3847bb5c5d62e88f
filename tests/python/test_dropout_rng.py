"""Random dropout draws its (seed, offset) from the inputs' device generator and the kernels read
it there: torch.compile(fullgraph=True) traces the call, a captured CUDA graph gets a new mask on
each replay, torch.manual_seed / torch.cuda.manual_seed reproduce it, and backward replays the
forward's mask. (Before, the seed came from the CPU generator through .item(): a graph break under
fullgraph, a host synchronisation that CUDA graph capture refuses.)"""
import pytest
import torch

import sdpa_math

P_DROP = 0.4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(device, dtype=torch.float32, requires_grad=False, L=16, S=24, E=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, n, E, generator=g, dtype=dtype).to(device).requires_grad_(requires_grad)
            for n in (L, S, S)]


def _check_dropout(out, probs, v, p=P_DROP, tol=1e-4):
    """O = P V with P the returned map (A ∘ M / (1 - p) for random dropout, as the math op's
    dropout returns it), and about a fraction p of it dropped."""
    torch.testing.assert_close(out.float(), probs.float() @ v.float(), rtol=tol, atol=tol)
    dropped = (probs == 0).float().mean().item()
    assert abs(dropped - p) < 0.1, dropped


@pytest.mark.parametrize("device", DEVICES)
def test_manual_seed_reproduces_the_mask_and_the_stream_moves_on(device):
    q, k, v = _inputs(device)
    torch.manual_seed(11)
    o1, p1 = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    o2, p2 = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    torch.manual_seed(11)
    o3, p3 = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    assert torch.equal(p1, p3) and torch.equal(o1, o3)
    assert not torch.equal(p1, p2)
    _check_dropout(o1, p1, v)


@cuda_only
def test_cuda_manual_seed_alone_reproduces_the_mask():
    q, k, v = _inputs("cuda")
    torch.cuda.manual_seed(5)
    _, p1 = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    torch.cuda.manual_seed(5)
    _, p2 = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    torch.cuda.manual_seed(6)
    _, p3 = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_replays_the_forward_mask(device):
    """The explicit mask M recovered from P gives the same O and P / (1 - p) (an explicit mask's P
    is A ∘ M, unscaled), so the gradients through both agree only if backward used that mask."""
    q, k, v = _inputs(device, torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 16, 16, dtype=torch.float64, device=device)
    out, probs = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    grads_random = torch.autograd.grad((out * g).sum() + probs.square().sum(), (q, k, v))
    keep = probs.detach() != 0
    out2, probs2 = sdpa_math.attention(q, k, v, dropout_p=P_DROP, dropout_mask=keep)
    grads_explicit = torch.autograd.grad((out2 * g).sum() + (probs2 / (1 - P_DROP)).square().sum(), (q, k, v))
    torch.testing.assert_close(out, out2)
    for a, b in zip(grads_random, grads_explicit):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fullgraph_with_random_dropout(device):
    """fullgraph=True fails on any graph break (the old .item() was one). Forward and backward run
    compiled; the gradients match the explicit mask that P shows."""
    torch._dynamo.reset()
    backend = "inductor" if device == "cuda" else "aot_eager"  # no C++ toolchain needed on the CPU

    def step(q, k, v):
        out, probs = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
        return out, probs

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    q, k, v = _inputs(device, requires_grad=True)
    out, probs = compiled(q, k, v)
    _check_dropout(out.detach(), probs.detach(), v.detach())
    out_b, probs_b = compiled(q, k, v)
    assert not torch.equal(probs, probs_b)  # a new mask per call
    grads = torch.autograd.grad(out.sum() + probs.square().sum(), (q, k, v))
    keep = probs.detach() != 0
    out2, probs2 = sdpa_math.attention(q, k, v, dropout_p=P_DROP, dropout_mask=keep)
    ref = torch.autograd.grad(out2.sum() + (probs2 / (1 - P_DROP)).square().sum(), (q, k, v))
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_graph_replays_draw_new_masks(dtype):
    q, k, v = _inputs("cuda", dtype, L=64, S=96, E=64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up outside the capture
            sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, probs = sdpa_math.attention(q, k, v, dropout_p=P_DROP)
    seen = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        tol = 2e-3 if dtype == torch.float16 else 1e-4
        _check_dropout(out, probs, v, tol=tol)
        seen.append(probs.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


def test_rng_tensor_is_checked():
    q, k, v = _inputs("cpu")
    with pytest.raises(RuntimeError, match="rng must be a contiguous int64 tensor of two elements"):
        torch.ops.sdpa_math.forward(q, k, v, None, 0.3, False, None, None, False, torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="rng must be a contiguous int64 tensor of two elements"):
        torch.ops.sdpa_math.forward(q, k, v, None, 0.3, False, None, None, False, torch.tensor([1.0, 2.0]))


@cuda_only
def test_rng_on_another_device_is_an_error():
    q, k, v = _inputs("cpu")
    with pytest.raises(RuntimeError, match="it must be on the CPU or on the inputs' device"):
        torch.ops.sdpa_math.forward(q, k, v, None, 0.3, False, None, None, False, torch.tensor([1, 2], device="cuda"))
