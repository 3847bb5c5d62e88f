"""The CUDA backend called from host threads that come and go (issue 14): the fp32 path's cuBLAS
handles are held per thread and returned to a pool when the thread ends, so a process that starts
many short-lived threads does not leak a handle per thread; threads running at once each get a
handle of their own and the right answer. Skipped without a GPU."""
import subprocess
import sys
import threading

import pytest
import torch

import sdpa_math

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
aten_math = torch.ops.aten._scaled_dot_product_attention_math
created = torch.ops.sdpa_math.cuda_blas_handles_created


def _fp32_call(errors: dict, n: int) -> None:
    """One fp32 call (the cuBLAS path) on this thread, its error against float64 kept in errors[n]."""
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", generator=g) for _ in range(3))
    out, probs = sdpa_math.attention(q, k, v)
    ref_out, ref_probs = aten_math(q.double(), k.double(), v.double())
    torch.cuda.synchronize()
    errors[n] = max((out.double() - ref_out).abs().max().item(), (probs.double() - ref_probs).abs().max().item())


def test_the_fp32_call_here_uses_cublas():
    """In a fresh process the count starts at 0 and this test's call makes it 1, so the thread
    tests below count handles of the path they mean to exercise."""
    code = ("import torch, sdpa_math; c = torch.ops.sdpa_math.cuda_blas_handles_created; n0 = c(); "
            "q = torch.randn(2, 4, 64, 32, device='cuda'); sdpa_math.attention(q, q, q); print(n0, c())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["0", "1"], run.stdout


def test_threads_that_come_and_go_reuse_cublas_handles():
    errors: dict = {}
    _fp32_call(errors, -1)  # this thread's own handle
    before = created()
    for n in range(40):  # one after another: each new thread takes the handle the last one gave back
        t = threading.Thread(target=_fp32_call, args=(errors, n))
        t.start()
        t.join()
    # join() can return before the thread's C++ thread_local destructors have run (CPython
    # releases the thread's state first), so the next thread may find the pool still empty now and
    # then: a few new handles, not one per thread (40 before the pool).
    assert created() - before <= 4, f"{created() - before} cuBLAS handles for 40 threads run one after another"
    assert len(errors) == 41 and max(errors.values()) < 1e-4


def test_threads_at_once_each_get_a_handle_and_the_right_answer():
    errors: dict = {}
    start = threading.Barrier(8)

    def run(n):
        start.wait()
        for rep in range(5):
            _fp32_call(errors, 100 * n + rep)

    before = created()
    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert created() - before <= 8 + 4  # one each at most, and the join slack above
    assert len(errors) == 40 and max(errors.values()) < 1e-4
