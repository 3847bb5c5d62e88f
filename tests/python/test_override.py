"""The aten override: F.scaled_dot_product_attention under the math backend and direct aten calls
are taken, equal sdpa_math.attention bit for bit, and disable() restores PyTorch's behaviour."""
import gc
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import sdpa_math

aten_math = torch.ops.aten._scaled_dot_product_attention_math


@pytest.fixture(autouse=True)
def _off_after():
    yield
    sdpa_math.disable()


def _qkv(requires_grad=False):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(2, 4, 9, 16, generator=g, requires_grad=requires_grad) for _ in range(3)]


def test_direct_aten_call_is_taken_and_bitwise_equal():
    q, k, v = _qkv()
    mask = torch.randn(9, 9)
    sdpa_math.enable()
    before = sdpa_math.interceptions()
    out, probs = aten_math(q, k, v, mask)
    assert sdpa_math.interceptions() == before + 1
    ref_out, ref_probs = sdpa_math.attention(q, k, v, mask)
    assert torch.equal(out, ref_out) and torch.equal(probs, ref_probs)


def test_functional_sdpa_under_math_backend_is_taken_with_grad():
    q, k, v = _qkv(requires_grad=True)
    sdpa_math.enable()
    before = sdpa_math.interceptions()
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert sdpa_math.interceptions() == before + 1
    ref_out, _ = sdpa_math.attention(q, k, v, is_causal=True)
    assert torch.equal(out, ref_out)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref_out.sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


def test_gradients_flow_through_probs_under_override():
    q, k, v = _qkv(requires_grad=True)
    with sdpa_math.override():
        out, probs = aten_math(q, k, v)
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum()
        (gq,) = torch.autograd.grad(out.sum() + entropy, (q,))
    # The same loss through PyTorch's own op.
    out_n, probs_n = aten_math(q, k, v)
    entropy_n = -(probs_n * probs_n.clamp_min(1e-12).log()).sum()
    (gq_n,) = torch.autograd.grad(out_n.sum() + entropy_n, (q,))
    torch.testing.assert_close(gq, gq_n, rtol=1e-4, atol=1e-5)


def test_disable_restores_native():
    q, k, v = _qkv()
    bool_mask = torch.rand(9, 9) > 0.5
    native = aten_math(q, k, v, bool_mask)  # native's quirk: adds 0/1
    sdpa_math.enable()
    ours = aten_math(q, k, v, bool_mask)
    assert not torch.allclose(ours[1], native[1])  # the override really changed the semantics
    sdpa_math.disable()
    before = sdpa_math.interceptions()
    again = aten_math(q, k, v, bool_mask)
    assert sdpa_math.interceptions() == before
    assert torch.equal(again[1], native[1]) and torch.equal(again[0], native[0])


def test_registration_survives_garbage_collection_and_context_restores():
    q, k, v = _qkv()
    with sdpa_math.override():
        gc.collect()
        before = sdpa_math.interceptions()
        aten_math(q, k, v)
        assert sdpa_math.interceptions() == before + 1
    assert not sdpa_math.is_enabled()
    before = sdpa_math.interceptions()
    aten_math(q, k, v)
    assert sdpa_math.interceptions() == before


def test_inference_mode_under_override():
    q, k, v = _qkv(requires_grad=True)
    sdpa_math.enable()
    before = sdpa_math.interceptions()
    with torch.inference_mode():
        out, probs = aten_math(q, k, v)
    assert sdpa_math.interceptions() == before + 1
    assert not out.requires_grad and out.grad_fn is None


def _run_threads(*targets, timeout=60):
    """Runs the targets in threads; re-raises the first failure in the test's thread."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def test_override_block_in_one_thread_survives_another_thread_leaving():
    """A enters, B enters, A leaves, B (still inside) must still be overridden. Before the blocks
    were reference-counted, A's exit (it had found the override off) disabled it under B."""
    q, k, v = _qkv()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with sdpa_math.override():
            a_in.set()
            assert b_in.wait(30)
        a_out.set()

    def thread_b():
        assert a_in.wait(30)
        with sdpa_math.override():
            b_in.set()
            assert a_out.wait(30)
            seen["enabled"] = sdpa_math.is_enabled()
            before = sdpa_math.interceptions()
            aten_math(q, k, v)
            seen["taken"] = sdpa_math.interceptions() - before

    _run_threads(thread_a, thread_b)
    assert seen == {"enabled": True, "taken": 1}
    assert not sdpa_math.is_enabled()  # the last block out restored PyTorch's kernels


def test_override_blocks_entered_and_left_together_from_many_threads():
    """Threads enter at once (a barrier), call the op, leave in a shuffled order; every call inside
    a block is taken, the count is exact, and the override is off after the last one."""
    q, k, v = _qkv()
    n, calls = 4, 25
    entered = threading.Barrier(n)
    leave_order = [threading.Event() for _ in range(n)]
    misses = []

    def worker(i):
        def run():
            with sdpa_math.override():
                entered.wait(30)
                for _ in range(calls):
                    if not sdpa_math.is_enabled():
                        misses.append(i)
                    aten_math(q, k, v)
                # leave in the order 2, 0, 3, 1: early leavers must not switch it off for the rest
                assert leave_order[i].wait(30)
            nxt = [2, 0, 3, 1]
            j = nxt.index(i)
            if j + 1 < n:
                leave_order[nxt[j + 1]].set()
        return run

    before = sdpa_math.interceptions()
    leave_order[2].set()
    _run_threads(*(worker(i) for i in range(n)))
    assert not misses
    assert sdpa_math.interceptions() - before == n * calls
    assert not sdpa_math.is_enabled()


def test_enable_and_disable_inside_a_block():
    q, k, v = _qkv()
    with sdpa_math.override():
        with sdpa_math.override():  # nested: counted, the outer block keeps it on
            pass
        assert sdpa_math.is_enabled()
        sdpa_math.enable()
    assert sdpa_math.is_enabled()  # enable() inside the block holds after it
    with sdpa_math.override():
        sdpa_math.disable()
        assert sdpa_math.is_enabled()  # the running block keeps it on
        before = sdpa_math.interceptions()
        aten_math(q, k, v)
        assert sdpa_math.interceptions() == before + 1
    assert not sdpa_math.is_enabled()


def test_deterministic_mode_with_grad_falls_back_to_the_math_ops_composition():
    """Our backward refuses deterministic mode where it sums in a varying order; under the override
    such calls go to the math op's own (deterministic) composition instead of raising."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 9, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 16, generator=gen, requires_grad=True) for _ in range(2))
    before_mode = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with sdpa_math.override():
            before = sdpa_math.interceptions()
            out, probs = aten_math(q, k, v, enable_gqa=True)
            assert sdpa_math.interceptions() == before  # not ours
            grads = torch.autograd.grad(out.sum() + probs.square().sum(), (q, k, v))
            with torch.no_grad():  # no gradient wanted: ours, deterministic
                aten_math(q, k, v, enable_gqa=True)
            assert sdpa_math.interceptions() == before + 1
    finally:
        torch.use_deterministic_algorithms(before_mode)
    out_n, probs_n = aten_math(q, k, v, enable_gqa=True)
    grads_n = torch.autograd.grad(out_n.sum() + probs_n.square().sum(), (q, k, v))
    for a, b in zip(grads, grads_n):
        assert torch.equal(a, b)
