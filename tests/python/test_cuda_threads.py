"""The CUDA backend called from host threads that come and go (issue 14): the fp32 path's cuBLAS
handles are held per thread and returned to a pool when the thread ends, so a process that starts
many short-lived threads does not leak a handle per thread; threads running at once each get a
handle of their own and the right answer. Skipped without a GPU."""
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


def test_threads_that_come_and_go_reuse_cublas_handles():
    errors: dict = {}
    _fp32_call(errors, -1)  # this thread's own handle
    before = created()
    assert before >= 1, "the fp32 CUDA call did not go through cuBLAS; this test needs a shape that does"
    for n in range(40):  # one after another: each new thread takes the handle the last one gave back
        t = threading.Thread(target=_fp32_call, args=(errors, n))
        t.start()
        t.join()
    assert created() - before <= 1, f"{created() - before} cuBLAS handles for 40 threads run one after another"
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
    assert created() - before <= 8
    assert len(errors) == 40 and max(errors.values()) < 1e-4
