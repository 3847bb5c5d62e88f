"""Where the sm90 forward differs from float64: per head, per 16-row group and per 16-key group,
for lse (pass 1 only), P and O (O also against our own P times V, which isolates P V)."""
import torch

import sdpa_math

torch.manual_seed(0)
for E, L, S in ((64, 130, 130), (128, 130, 300), (64, 256, 256)):
    q, k, v = (torch.randn(1, 2, n, E, device="cuda", dtype=torch.float16) for n in (L, S, S))
    o, p, lse = torch.ops.sdpa_math.forward(q, k, v, None, 0.0, False, None, None, False, None)
    s = q.double() @ k.double().transpose(-1, -2) * E ** -0.5
    rlse = torch.logsumexp(s, -1)
    rp = torch.softmax(s, -1)
    ro = rp @ v.double()
    print(f"E={E} L={L} S={S}: lse err {(lse.double() - rlse).abs().max().item():.3e}  P err {(p.double() - rp).abs().max().item():.3e}"
          f"  O err {(o.double() - ro).abs().max().item():.3e}  O vs ourP@V {(o.double() - p.double() @ v.double()).abs().max().item():.3e}")
    e = (p.double() - rp).abs()
    for h in range(2):
        rows = [f"{e[0, h, r:r + 16].max().item():.0e}" for r in range(0, L, 16)]
        cols = [f"{e[0, h, :, c:c + 16].max().item():.0e}" for c in range(0, S, 16)]
        print(f"  head {h} P err by 16 rows: {' '.join(rows)}")
        print(f"  head {h} P err by 16 keys: {' '.join(cols)}")
        le = (lse.double() - rlse).abs()[0, h]
        print(f"  head {h} lse err by 16 rows: {' '.join(f'{le[r:r + 16].max().item():.0e}' for r in range(0, L, 16))}")
