"""Two processes under torch.distributed (NCCL), one GPU each: each rank computes half of the
heads (forward and backward through O and P), the halves are gathered, and they must match one
GPU computing every head. Skipped without two CUDA devices and NCCL."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
    reason="needs two CUDA devices and NCCL")

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.multiprocessing as mp
    import sdpa_math

    B, H, L, S, E = 2, 8, 200, 264, 64

    def problem():
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, n, E, generator=g) for n in (L, S, S))
        d_out = torch.randn(B, H, L, E, generator=g)
        d_probs = torch.randn(B, H, L, S, generator=g)
        return q, k, v, d_out, d_probs

    def run(device, heads, dtype):
        q, k, v, d_out, d_probs = (t[:, heads].to(device, dtype) for t in problem())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, probs = sdpa_math.attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad((out, probs), (q, k, v), (d_out, d_probs))
        return [out.detach(), probs.detach(), *grads]

    def worker(rank, init, dtype_name):
        dtype = getattr(torch, dtype_name)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
        half = H // 2
        mine = run(torch.device("cuda", rank), slice(rank * half, (rank + 1) * half), dtype)
        gathered = []
        for t in mine:
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous())
            gathered.append(torch.cat(parts, dim=1))
        if rank == 0:
            whole = run(torch.device("cuda", 0), slice(0, H), dtype)
            names = ["out", "probs", "dq", "dk", "dv"]
            worst = max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
                        for a, b in zip(gathered, whole))
            for name, a, b in zip(names, gathered, whole):
                print(name, float((a.double() - b.double()).abs().max()), flush=True)
            print("worst", worst, flush=True)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2, join=True)
""")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_two_ranks_each_take_half_the_heads_and_match_one_gpu(tmp_path, dtype):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    init = f"file://{tmp_path / 'rendezvous'}"
    run = subprocess.run([sys.executable, str(script), init, dtype], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    values = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    # The same kernels on the same heads: equal up to the order of the backward's fp32 additions.
    assert float(values["worst"]) < (2e-3 if dtype == "float16" else 1e-5), run.stdout
