"""Prefill with KV-cache compression: kvpress's own presses against sdpa_math's (issue 47).

Times one prefill (model forward on L tokens with the press's hook pruning every layer's cache)
of a tiny random Llama, median of --repeat runs after a warm-up, same process, same weights and
tokens; and, in one untimed run per route, the most (L, S) planes one op's output held (H for
the whole map of a layer, 1 for a causal mask, 0 for none). Needs the kvpress environment (scripts/setup_kvpress_env.sh):

    PYTHONPATH=python KVENV/bin/python bench/kvpress_prefill.py [--tokens 2048] [--threads N]

Routes per press (compression 0.5):
  H2O     kvpress ObservedAttentionPress on eager | ours on exact_attention (the layer's own
          call gives the column sums) | ours on sdpa (a second, fused pass over recomputed queries)
  SnapKV  kvpress SnapKVPress on sdpa (window by hand) | ours on sdpa (window's column sums, fused)
          | ours on exact_attention (the window's rows from the layer's call)
  TOVA    kvpress TOVAPress on sdpa | ours on sdpa | ours on exact_attention
and, for scale, the prefill without a press on eager, sdpa and exact_attention. Then the scoring
alone: one layer's score() on the arguments its hook received (SnapKV, TOVA; H2O's second pass).
"""
import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MapPlanes(TorchDispatchMode):
    """The most (L, S) planes that one tensor returned by an op held while active: H x B for an
    attention map, 1 for a causal mask, 0 where no op returned anything of P's trailing shape."""

    def __init__(self, L):
        super().__init__()
        self.L, self.planes = L, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.L, self.L):
                self.planes = max(self.planes, t.numel() // (self.L * self.L))
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
    # Routes interleaved (one run of each per round) so that a busy machine slows them alike.
    for name, impl, press in routes:  # warm-up
        model.set_attn_implementation(impl)
        prefill(press)
    times = {i: [] for i in range(len(routes))}
    for _ in range(args.repeat):
        for i, (name, impl, press) in enumerate(routes):
            model.set_attn_implementation(impl)
            t0 = time.perf_counter()
            prefill(press)
            times[i].append((time.perf_counter() - t0) * 1e3)
    print(f"{'press':<16}{'attention':<17}{'prefill ms':>11}{'min ms':>8}{'(L,S) planes':>13}{'kept':>6}")
    for i, (name, impl, press) in enumerate(routes):
        model.set_attn_implementation(impl)
        mode = MapPlanes(L)
        cache = prefill(press, mode)
        print(f"{name:<16}{impl:<17}{statistics.median(times[i]):>11.1f}{min(times[i]):>8.1f}{mode.planes:>13}"
              f"{cache.layers[0].keys.shape[2]:>6}")

    # The scoring alone (what the presses change where the model's attention is the same): one
    # layer's score() on the arguments its hook received, median of 3 x repeat calls.
    model.set_attn_implementation("sdpa")
    grab = {}

    def keep(module, hidden_states, keys, values, attentions, kwargs):
        grab.setdefault("args", (module, hidden_states, keys, values, attentions, kwargs))
        return keys.norm(dim=-1)

    probe = kvpress.KnormPress(0.5)
    probe.score = keep
    prefill(probe)
    pairs = [("SnapKV", kvpress.SnapKVPress(0.5, window_size=w), ours.FusedSnapKVPress(0.5, window_size=w)),
             ("TOVA", kvpress.TOVAPress(0.5), ours.FusedTOVAPress(0.5)),
             ("H2O (second pass)", None, ours.FusedObservedAttentionPress(0.5))]
    print(f"score() of one layer on sdpa: {'press':<18}{'kvpress ms':>11}{'ours ms':>9}")
    for name, theirs, mine in pairs:
        row = []
        for press in (theirs, mine):
            if press is None:
                row.append(float("nan"))
                continue
            with torch.no_grad():
                press.score(*grab["args"])
                ts = []
                for _ in range(3 * args.repeat):
                    t0 = time.perf_counter()
                    press.score(*grab["args"])
                    ts.append((time.perf_counter() - t0) * 1e3)
            row.append(statistics.median(ts))
        print(f"{'':<30}{name:<18}{row[0]:>11.2f}{row[1]:>9.2f}")

if __name__ == "__main__":
    main()
