"""Forward and forward+backward of one anchor shape, a few times, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:'forward_tc|backward_tc|decode_' --launch-skip 4 \
        --launch-count 4 python3 tests/gpu/profile_anchor.py prefill1k_d128

The first calls warm up; ncu skips them with --launch-skip.
"""
import sys

import torch

import sdpa_math
from sdpa_math.bench import ANCHORS


def main(name):
    shape = next(s for s in ANCHORS if s.name == name)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def t(*dims):
        return torch.randn(*dims, device="cuda", dtype=torch.float16, generator=gen).requires_grad_(True)

    q = t(shape.B, shape.Hq, shape.L, shape.D)
    k, v = t(shape.B, shape.Hkv, shape.S, shape.D), t(shape.B, shape.Hkv, shape.S, shape.D)
    for _ in range(3):
        out, probs = sdpa_math.attention(q, k, v, None, 0.0, shape.causal, enable_gqa=shape.Hq != shape.Hkv)
        torch.autograd.grad((out, probs), (q, k, v), (torch.randn_like(out), torch.randn_like(probs)))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "prefill1k_d128")
