"""Prefill with KV-cache compression: kvpress's own presses against sdpa_math's (issue 47).

Times one prefill (model forward on L tokens with the press's hook pruning every layer's cache)
of a tiny random Llama, median of --repeat runs after a warm-up, same process, same weights and
tokens; and, in one untimed run per route, the largest tensor any op returned (a whole
(B, H, L, S) map or not). Needs the kvpress environment (scripts/setup_kvpress_env.sh):

    PYTHONPATH=python KVENV/bin/python bench/kvpress_prefill.py [--tokens 2048] [--threads N]

Routes per press (compression 0.5):
  H2O     kvpress ObservedAttentionPress on eager | ours on exact_attention (the layer's own
          call gives the column sums) | ours on sdpa (a second, fused pass over recomputed queries)
  SnapKV  kvpress SnapKVPress on sdpa (window by hand) | ours on sdpa (window's column sums, fused)
          | ours on exact_attention (the window's rows from the layer's call)
  TOVA    kvpress TOVAPress on sdpa | ours on sdpa | ours on exact_attention
and, for scale, the prefill without a press on eager, sdpa and exact_attention.
"""
import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import kvpress
    import transformers
    from transformers import DynamicCache

    import sdpa_math.integrations.transformers  # noqa: F401  (registers "exact_attention")
    from sdpa_math.integrations import kvpress as ours

    H, L = args.heads, args.tokens
    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=H * args.head_dim, intermediate_size=2 * H * args.head_dim,
                                   num_hidden_layers=args.layers, num_attention_heads=H, num_key_value_heads=args.kv_heads,
                                   head_dim=args.head_dim, max_position_embeddings=max(4096, L), initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(getattr(torch, args.dtype))
    ids = torch.randint(0, 1024, (1, L), generator=torch.Generator().manual_seed(1))
    w = args.window
    routes = [
        ("none", "eager", None), ("none", "sdpa", None), ("none", "exact_attention", None),
        ("H2O kvpress", "eager", kvpress.ObservedAttentionPress(0.5)),
        ("H2O ours", "exact_attention", ours.FusedObservedAttentionPress(0.5)),
        ("H2O ours", "sdpa", ours.FusedObservedAttentionPress(0.5)),
        ("SnapKV kvpress", "sdpa", kvpress.SnapKVPress(0.5, window_size=w)),
        ("SnapKV ours", "sdpa", ours.FusedSnapKVPress(0.5, window_size=w)),
        ("SnapKV ours", "exact_attention", ours.FusedSnapKVPress(0.5, window_size=w)),
        ("TOVA kvpress", "sdpa", kvpress.TOVAPress(0.5)),
        ("TOVA ours", "sdpa", ours.FusedTOVAPress(0.5)),
        ("TOVA ours", "exact_attention", ours.FusedTOVAPress(0.5)),
    ]

    def prefill(press, mode=None):
        cache = DynamicCache()
        with torch.no_grad(), press(model) if press is not None else torch.no_grad():
            if mode is not None:
                with mode:
                    model(ids, past_key_values=cache)
            else:
                model(ids, past_key_values=cache)
        return cache

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}; "
          f"Llama {args.layers} layers, {H} heads / {args.kv_heads} KV heads, head dim {args.head_dim}, "
          f"{L} tokens, {args.dtype}, compression 0.5, SnapKV window {w}; median of {args.repeat}")
    map_numel = H * L * L
    print(f"{'press':<16}{'attention':<17}{'prefill ms':>11}{'largest tensor':>16}{'kept':>6}")
    for name, impl, press in routes:
        model.set_attn_implementation(impl)
        cache = prefill(press)  # warm-up
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            prefill(press)
            times.append((time.perf_counter() - t0) * 1e3)
        mode = Largest()
        prefill(press, mode)
        big = f"{mode.numel / map_numel:.3g} maps" if mode.numel >= map_numel / 8 else f"{mode.numel:,}"
        print(f"{name:<16}{impl:<17}{statistics.median(times):>11.1f}{big:>16}{cache.layers[0].keys.shape[2]:>6}")


if __name__ == "__main__":
    main()
