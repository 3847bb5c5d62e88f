"""Two GPUs: the op runs on cuda:1 while cuda:0 is current, and creates no CUDA context on cuda:0.

Custom ops get no device guard from the dispatcher; the binding takes PyTorch's (which restores
the caller's device without creating a context there) and the core's own guard restores only what
it changed. Before, the core's guard ended every call with cudaSetDevice(previous), which creates
the previous device's context (cuda:0 by default) even when all work was on cuda:1. Skipped
without two GPUs; run in a fresh process, so that no earlier test has touched cuda:0.
"""
import subprocess
import sys
import textwrap

import pytest
import torch

import sdpa_math  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

CODE = textwrap.dedent("""
    import torch, sdpa_math
    assert torch.cuda.current_device() == 0
    dev = torch.device("cuda:1")
    g = torch.Generator().manual_seed(0)
    inputs = {dt: [torch.randn(2, 4, 40, 64, generator=g).to(dev, dt).requires_grad_(True) for _ in range(3)]
              for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    torch.cuda.synchronize(dev)
    print("context_on_0_before", torch._C._cuda_hasPrimaryContext(0))
    for dt, (q, k, v) in inputs.items():
        out, probs = sdpa_math.attention(q, k, v, is_causal=True)
        assert out.device == dev and probs.device == dev
        (out.float().sum() + probs.float().square().sum()).backward()
        ref_out, ref_probs = sdpa_math.attention(*(x.detach().cpu().double() for x in (q, k, v)), is_causal=True)
        tol = 1e-2 if dt in (torch.float16, torch.bfloat16) else 1e-5
        torch.testing.assert_close(out.detach().cpu().double(), ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(probs.detach().cpu().double(), ref_probs, rtol=tol, atol=tol)
    x = torch.randn(4, device=dev)
    try:
        sdpa_math.attention(x, x, x)
    except RuntimeError:
        pass
    torch.cuda.synchronize(dev)
    print("current_device", torch.cuda.current_device())
    print("context_on_0_after", torch._C._cuda_hasPrimaryContext(0))
""")


def test_runs_on_cuda1_without_a_context_on_cuda0():
    run = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    if lines.get("context_on_0_before") != "False":
        pytest.skip("PyTorch itself created a context on cuda:0 before the op ran")
    assert lines["current_device"] == "0"
    assert lines["context_on_0_after"] == "False"
