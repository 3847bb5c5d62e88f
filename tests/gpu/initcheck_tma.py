"""Are initcheck's reports on the Hopper backward (16-byte reads of O and P rows in delta_rows)
reads of memory the forward wrote with TMA bulk stores, which initcheck may not track? One sm90
forward, then the backward, given (a) the forward's own O and P, (b) clones of them (PyTorch copies
a contiguous tensor with cudaMemcpyAsync, which carries initcheck's status from the source), or
(c) copies made by an elementwise kernel (x * 1: ordinary stores). Run each under initcheck:

    compute-sanitizer --tool initcheck python3 tests/gpu/initcheck_tma.py own|clones|kernel

If (a) and (b) report and (c) does not, the backward reads only what was written, and the reports
are initcheck not following the forward's TMA stores. Two shapes: whole tiles, and tails in L and S.
(results: bench/results/h200-s14-initcheck-tma.txt)"""
import sys

import torch

import sdpa_math  # noqa: F401  (loads the ops)

ops = torch.ops.sdpa_math


def main(which):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for L, S in ((256, 256), (130, 200)):
        q = torch.randn(1, 2, L, 64, device="cuda", dtype=torch.float16, generator=gen)
        k, v = (torch.randn(1, 2, S, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
        out, probs, lse = ops.forward(q, k, v, None, 0.0, False, None, None, False, None)
        g_out, g_probs = torch.randn_like(out), torch.randn_like(probs)
        copies = {"own": lambda: (out, probs), "clones": lambda: (out.clone(), probs.clone()),
                  "kernel": lambda: (out * 1, probs * 1)}
        saved_out, saved_probs = copies[which]()  # only the chosen variant runs
        grads = ops.backward(g_out, g_probs, q, k, v, None, lse, saved_out, saved_probs, 0.0, False, None, None,
                             False, None, [True, True, True, False])
        torch.cuda.synchronize()
        print(which, L, S, "dq norm", grads[0].float().norm().item())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "own")
