"""One side of the end-to-end check: the TinyLlama of sdpa_math.models, on PyTorch's own
attention op or (with --impl sdpa_math) under sdpa_math.enable(), in a process of its own.

    python -m sdpa_math.model_check --impl native|sdpa_math [--device cpu|cuda] --out FILE.pt

Saves, for the same seeded weights and tokens: the no-grad logits, a greedy generation, the
gradients of the embedding, the first query projection and the head for cross-entropy training
and for cross-entropy + attention entropy, the latency of each, and how many aten calls the
override took. `compare()` puts two such files side by side.
"""
from __future__ import annotations

import argparse

import torch

from .bench import median_ms
from .models import TinyLlama, TinyLlamaConfig, greedy, loss_of

ENTROPY_WEIGHT = 0.05
GRADS = {"embed": lambda m: m.embed.weight, "q_proj0": lambda m: m.blocks[0].attn.q.weight,
         "head": lambda m: m.head.weight}


def run(impl, device, batch=2, length=None, reps=5):
    import sdpa_math

    if impl == "sdpa_math":
        sdpa_math.enable()
    cfg = TinyLlamaConfig.for_device(device)
    dtype = torch.float16 if device == "cuda" else torch.float32
    length = length or (512 if device == "cuda" else 64)
    torch.manual_seed(0)
    model = TinyLlama(cfg).to(device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)
    before = sdpa_math.interceptions()
    res = {"impl": impl, "device": device, "dtype": str(dtype), "config": vars(cfg), "batch": batch, "length": length}

    with torch.no_grad():
        res["logits"] = model(ids)[0].float().cpu()
    res["generation"] = greedy(model, ids[:, : length // 2], 8).cpu()

    def train_step(weight):
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, ids, weight)
        loss.backward()
        return loss

    for mode, weight in (("ce", 0.0), ("ce_entropy", ENTROPY_WEIGHT)):
        res[f"loss_{mode}"] = train_step(weight).item()
        res[f"grads_{mode}"] = {k: f(model).grad.float().cpu() for k, f in GRADS.items()}

    def forward_no_grad():
        with torch.no_grad():
            model(ids)

    res["ms_forward"] = median_ms(forward_no_grad, device, warmup=2, reps=reps)[0]
    res["ms_ce"] = median_ms(lambda: train_step(0.0), device, warmup=2, reps=reps)[0]
    res["ms_ce_entropy"] = median_ms(lambda: train_step(ENTROPY_WEIGHT), device, warmup=2, reps=reps)[0]
    res["interceptions"] = sdpa_math.interceptions() - before
    return res


def compare(native, ours):
    """Rows of the side-by-side comparison: (what, value) pairs, errors and agreement."""
    rows = {}
    rows["logits_linf"] = (ours["logits"] - native["logits"]).abs().max().item()
    rows["logits_scale"] = native["logits"].abs().max().item()
    rows["top1_agreement"] = (ours["logits"].argmax(-1) == native["logits"].argmax(-1)).float().mean().item()
    rows["generation_identical"] = bool(torch.equal(ours["generation"], native["generation"]))
    for mode in ("ce", "ce_entropy"):
        rows[f"loss_{mode}_diff"] = abs(ours[f"loss_{mode}"] - native[f"loss_{mode}"])
        for k in GRADS:
            a, b = ours[f"grads_{mode}"][k], native[f"grads_{mode}"][k]
            rows[f"grad_{mode}_{k}_linf_rel"] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    for t in ("ms_forward", "ms_ce", "ms_ce_entropy"):
        rows[f"{t}_native"], rows[f"{t}_sdpa_math"] = native[t], ours[t]
        rows[f"{t}_speedup"] = native[t] / ours[t]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sdpa_math.model_check")
    ap.add_argument("--impl", choices=["native", "sdpa_math"], required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.save(run(a.impl, a.device), a.out)


if __name__ == "__main__":
    main()
