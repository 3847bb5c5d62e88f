"""`python -m sdpa_math demo`: sdpa_math on a small model and a built-in input, no downloads.

Builds the TinyLlama of sdpa_math.models with seeded random weights (the GPU's sizes when there
is a GPU, smaller on the CPU), feeds it the bytes of a built-in sentence, and on the first layer's
query, key and value compares sdpa_math with PyTorch's math op and with eager attention: the
largest error of O and P, the time of each, and each head's attention entropy. Writes heatmaps of
the attention maps of a few heads to a PNG and prints its path.
"""
from __future__ import annotations

import argparse
import pathlib

import torch

import sdpa_math

from .bench import eager_attention, median_ms
from .models import TinyLlama, TinyLlamaConfig, rotary_tables

TEXT = ("sdpa_math returns the attention output and the full probability map, with gradients through "
        "both, so attention entropy, distillation and head analysis run at fused-kernel speed.")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sdpa_math demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="sdpa_math_demo.png", help="where to write the heatmaps")
    a = ap.parse_args(argv)
    device = a.device
    dtype = torch.float16 if device == "cuda" else torch.float32
    cfg = TinyLlamaConfig.for_device(device)
    torch.manual_seed(0)
    model = TinyLlama(cfg).to(device=device, dtype=dtype).eval()
    ids = torch.tensor([list(TEXT.encode())], device=device) % cfg.vocab_size
    L = ids.shape[1]
    with torch.no_grad():
        x = model.embed(ids)
        cos, sin = rotary_tables(L, cfg.head_dim, cfg.rope_theta, device, dtype)
        q, k, v = model.blocks[0].attn.qkv(model.blocks[0].attn_norm(x), cos, sin)
        scale = cfg.head_dim ** -0.5

        def ours():
            return sdpa_math.attention(q, k, v, is_causal=True, enable_gqa=True)

        def native():
            return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, enable_gqa=True)

        def eager():
            return eager_attention(q, k, v, True, scale)

        o, p = ours()
        o_n, p_n = native()
        t_ours, t_native, t_eager = (median_ms(f, device, reps=20)[0] for f in (ours, native, eager))
    entropy = -(p.float() * p.float().clamp_min(1e-30).log()).sum(-1).mean(dim=(0, 2))
    print(f"sdpa_math demo · {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}) · "
          f"{str(dtype).split('.')[-1]} · TinyLlama layer 0: {cfg.heads} query / {cfg.kv_heads} key-value heads, "
          f"head dim {cfg.head_dim}, {L} tokens (the bytes of a built-in sentence)")
    print(f"  max |O - O_math| = {(o.float() - o_n.float()).abs().max().item():.3e}    "
          f"max |P - P_math| = {(p.float() - p_n.float()).abs().max().item():.3e}")
    print(f"  time: sdpa_math {t_ours:.3f} ms · PyTorch math op {t_native:.3f} ms ({t_native / t_ours:.2f}x) · "
          f"eager attention {t_eager:.3f} ms ({t_eager / t_ours:.2f}x)")
    print("  attention entropy per head (nats; uniform causal rows would average "
          f"{torch.log(torch.arange(1, L + 1).float()).mean().item():.2f}):")
    print("    " + "  ".join(f"h{h}: {e:.2f}" for h, e in enumerate(entropy.tolist())))
    out = pathlib.Path(a.out).resolve()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib is not installed: no heatmaps; `pip install matplotlib`)")
        return 0
    heads = [0, 1, cfg.heads // 2, cfg.heads - 1]
    fig, axes = plt.subplots(1, len(heads), figsize=(4 * len(heads), 4))
    for ax, h in zip(axes, heads):
        ax.imshow(p[0, h].float().cpu().numpy() ** 0.5, cmap="magma", interpolation="nearest")
        ax.set_title(f"layer 0, head {h} (kv {h // (cfg.heads // cfg.kv_heads)}), H={entropy[h]:.2f}")
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.suptitle("attention maps P returned by sdpa_math (square-root colour scale)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"  heatmaps: {out}")
    return 0
