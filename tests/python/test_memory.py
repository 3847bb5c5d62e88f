"""Out of memory is an error the caller gets, and the process goes on (issue 14).

The CPU kernels take scratch rows per thread inside OpenMP regions, where an exception would end
the process; they now hand the first one to the caller (src/cpu/parallel.h), and the binding
reports std::bad_alloc as a RuntimeError, as PyTorch's CPU allocator does. In a subprocess, with
the address space limited to what the outputs need but not the scratch rows: one query row against
32M keys (E = 1) needs 128 MB for P and about 1.3 GB of scratch in the forward, 3.5 GB in the
backward. On CUDA the outputs and the kernels' scratch come from PyTorch's caching allocator,
which raises torch.OutOfMemoryError itself: tested with a P larger than the GPU and with the
allocator capped below what a backward needs.)"""
import subprocess
import sys

import pytest

CHILD = r"""
import resource, torch, sdpa_math

def vm_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024

def limited(fn):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (768 << 20), hard))
    try:
        fn()
        return "no error"
    except RuntimeError as e:
        return "raised: " + str(e).splitlines()[0]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

S = 1 << 25
q = torch.randn(1, 1, 1, 1)
k, v = torch.randn(1, 1, S, 1), torch.randn(1, 1, S, 1)
sdpa_math.attention(q, k[..., :64, :], v[..., :64, :])  # threads and libraries loaded before the limit
print("forward", limited(lambda: sdpa_math.attention(q, k, v)))
qg = q.clone().requires_grad_()
out, probs = sdpa_math.attention(qg, k, v)
print("backward", limited(lambda: torch.autograd.grad(probs, qg, torch.ones_like(probs))))
del out, probs
out, probs = sdpa_math.attention(q, k[..., :100, :], v[..., :100, :])
print("after", round(float(probs.sum()), 4))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and RLIMIT_AS")
def test_cpu_out_of_memory_raises_and_the_process_goes_on():
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    for step in ("forward", "backward"):
        assert lines[step].startswith("raised: ") and "can't allocate memory" in lines[step], run.stdout
    assert lines["after"] == "1.0", run.stdout


CUDA_CHILD = r"""
import torch, sdpa_math

def attempt(fn):
    try:
        fn()
        return "no error"
    except torch.OutOfMemoryError as e:
        return "oom: " + str(e).splitlines()[0][:80]
    except RuntimeError as e:  # anything else (an abort would end the process) is reported as is
        return "other: " + type(e).__name__ + " " + str(e).splitlines()[0][:200]

dev = torch.device("cuda")
# A forward whose P alone (64 x 65536^2 fp16, 512 GiB) is more than the GPU holds.
q = torch.randn(1, 64, 65536, 64, device=dev, dtype=torch.float16)
print("forward", attempt(lambda: sdpa_math.attention(q, q, q)))
del q
# Backwards with the caching allocator held to what is reserved after the forward plus 1 MiB (the
# gradients cannot be had) and plus 50 MiB (the three 16 MiB gradients can, the kernels' 32 MiB
# fp32 workspace, from the same allocator, cannot). Every tensor is 10 MiB or more, so each has a
# segment of its own and no allocation fits in the free tail of another's; the incoming gradients
# exist beforehand, so the first allocations of the backward are the op's own.
torch.cuda.empty_cache()
q, k, v = (torch.randn(2, 16, 2048, 128, device=dev, dtype=torch.float16, requires_grad=True) for _ in range(3))
out, probs = sdpa_math.attention(q, k, v)
d_out, d_probs = torch.randn_like(out), torch.randn_like(probs)
torch.cuda.synchronize()
torch.cuda.empty_cache()
total = torch.cuda.get_device_properties(dev).total_memory
for name, spare in (("backward_outputs", 1 << 20), ("backward_scratch", 50 << 20)):
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + spare) / total)
    print(name, attempt(lambda: torch.autograd.grad((out, probs), (q, k, v), (d_out, d_probs), retain_graph=True)))
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()
grads = torch.autograd.grad((out, probs), (q, k, v), (d_out, d_probs))
ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
o64, p64 = sdpa_math.attention(*ref)
ref_grads = torch.autograd.grad((o64, p64), ref, (d_out.double(), d_probs.double()))
err = max(float((g.double() - r).abs().max() / r.abs().max()) for g, r in zip(grads, ref_grads))
print("after", "ok" if err < 2e-2 else f"gradients off by {err}")
"""


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_out_of_memory_raises_torch_error_and_the_process_goes_on():
    run = subprocess.run([sys.executable, "-c", CUDA_CHILD], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stdout}\n{run.stderr[-2000:]}"
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    for step in ("forward", "backward_outputs", "backward_scratch"):
        assert lines[step].startswith("oom: "), run.stdout
    assert lines["after"] == "ok", run.stdout
