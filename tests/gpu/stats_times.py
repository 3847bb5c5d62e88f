"""Median GPU time of the statistics forward (`attention_stats`, fused) per request on the anchor
shapes, beside flash attention's forward: for comparing kernel versions in one GPU call (the
side-by-side harness is `python -m sdpa_math.bench stats`).

    python3 tests/gpu/stats_times.py [float16|bfloat16]

Requests: cols+ent (column sums and row entropy: two passes everywhere), ent (row entropy alone),
rows64 (P's last 64 rows alone); the last two run one pass in every CTA without window rows.
Decode shapes (up to 4 query rows) take the decode kernels for all three.
"""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from forward_times import SHAPES, median_ms  # noqa: E402

from sdpa_math.stats import attention_stats  # noqa: E402


def main():
    dtype = getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float16
    requests = {"cols+ent": dict(col_sum="per_head", row_entropy=True), "ent": dict(row_entropy=True),
                "rows64": dict(rows=slice(-64, None))}
    for name, (B, H, Hkv, L, S, E, causal) in SHAPES.items():
        q = torch.randn(B, H, L, E, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=dtype) for _ in range(2))
        gqa = H != Hkv
        cells = []
        with torch.no_grad():
            flash = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa))
            for req, kw in requests.items():
                try:
                    ms = median_ms(lambda: attention_stats(q, k, v, is_causal=causal, enable_gqa=gqa, method="fused",
                                                           **kw))
                    cells.append(f"{req} {ms:.3f} ({ms / flash:.2f}x)")
                except ValueError:  # no fused kernel takes it (rows of an odd S on Hopper)
                    cells.append(f"{req} -")
        print(f"{name:24s} flash {flash:.3f}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
