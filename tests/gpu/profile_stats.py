"""The Hopper statistics kernel and the forward on one anchor shape, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:forward_sm90 --launch-skip 4 --launch-count 2 \
        python3 tests/gpu/profile_stats.py prefill1k_d128

Each round runs attention_stats (column sums and entropy, the STATS kernel) and then the forward
with P; the first two rounds warm up (ncu skips their 4 launches).
"""
import sys

import torch

import sdpa_math
from sdpa_math.bench import ANCHORS
from sdpa_math.stats import attention_stats


def main(name):
    s = next(a for a in ANCHORS if a.name == name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s.B, h, n, s.D, device="cuda", dtype=torch.float16, generator=gen)
               for h, n in ((s.Hq, s.L), (s.Hkv, s.S), (s.Hkv, s.S)))
    kw = dict(is_causal=s.causal, enable_gqa=s.Hq != s.Hkv)
    for _ in range(3):
        attention_stats(q, k, v, col_sum="per_head", row_entropy=True, method="fused", **kw)
        sdpa_math.attention(q, k, v, **kw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "prefill1k_d128")
