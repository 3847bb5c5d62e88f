"""Which bench shapes the Hopper statistics kernel takes (forward_stats_has_kernel), for the notes."""
import torch

from sdpa_math.bench import ANCHORS, make_inputs

for s in ANCHORS:
    q, k, v, _ = make_inputs(s, torch.float16, "cuda")
    ok = torch.ops.sdpa_math.forward_stats_has_kernel(q, k, v, None, s.causal, None, s.Hq != s.Hkv, True, True, 0)
    print(f"{s.name:24s} q {tuple(q.shape)} strides {q.stride()} kernel {ok}")
