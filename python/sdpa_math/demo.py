"""`python -m sdpa_math demo`: a tiny model learns an induction head in seconds, no downloads.

The task: n distinct random tokens, then the same n tokens again; after the first repeated token
the model must predict each next token, which it can only do by finding the previous occurrence
of the current token and copying the token that followed it (an induction head, fed by a
previous-token head in the layer below). n varies between training batches, so attending a fixed
distance back does not solve it. A two-layer TinyLlama (sdpa_math.models) with seeded random
weights trains for 1000 steps (10 to 20 s on two CPU cores), every attention computed by
sdpa_math.attention, which returns the probability maps P with gradients; the loss is the
cross-entropy of the predictable tokens plus a small weight times the mean row entropy of the
last layer's maps, which sharpens them. Prints the progress, then before and after training the
task accuracy, that entropy and the best induction and previous-token head scores; a check that
sdpa_math's O and P equal PyTorch's math op on the trained model's queries, keys and values; and
writes the maps of a few heads before (top row) and after (bottom row) training to a PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time

import torch
from torch import nn

import sdpa_math

from .models import TinyLlama, TinyLlamaConfig, attention_entropy, rotary_tables

VOCAB = 32           # task tokens
HALF = 16            # length of the random half in the evaluation and the picture: 2 * HALF tokens
HALVES = (8, 16)     # the training batches' half lengths, drawn per step: a varying offset between
                     # the two occurrences, so that copying from a fixed distance back cannot solve it
ENTROPY_LAYER = -1   # the layer whose attention entropy is in the loss (the induction layer)
ENTROPY_WEIGHT = 0.02
STEPS = 1000


def demo_config():
    """Two layers of 4 query / 2 key-value heads of dim 16: small enough to train on a CPU in seconds."""
    return TinyLlamaConfig(vocab_size=VOCAB, layers=2, heads=4, kv_heads=2, head_dim=16, mlp_dim=128)


def induction_batch(batch, generator, device, half=HALF, vocab=VOCAB):
    """(batch, 2 * half) token ids: half distinct random tokens, then the same tokens again."""
    first = torch.rand(batch, vocab, generator=generator).argsort(dim=1)[:, :half]
    return torch.cat([first, first], dim=1).to(device)


def forward(model, ids, keep_qkv=False):
    """TinyLlama's forward with every attention computed by sdpa_math.attention. Returns the
    logits, each layer's maps P (B, heads, L, L) and, with keep_qkv, each layer's (q, k, v)."""
    B, L = ids.shape
    x = model.embed(ids)
    cos, sin = rotary_tables(L, model.cfg.head_dim, model.cfg.rope_theta, ids.device, x.dtype)
    maps, qkvs = [], []
    for block in model.blocks:
        q, k, v = block.attn.qkv(block.attn_norm(x), cos, sin)
        out, probs = sdpa_math.attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + block.attn.o(out.transpose(1, 2).reshape(B, L, -1))
        h = block.mlp_norm(x)
        x = x + block.down(nn.functional.silu(block.gate(h)) * block.up(h))
        maps.append(probs)
        if keep_qkv:
            qkvs.append((q, k, v))
    return model.head(model.norm(x)), maps, qkvs


def task_logits_targets(logits, ids, half=HALF):
    """The predictable positions: queries half .. 2*half-2 predict tokens half+1 .. 2*half-1."""
    return logits[:, half:-1], ids[:, half + 1:]


def head_scores(maps, half=HALF):
    """Per layer and head, the mean attention the predictable rows put on the key an induction
    head wants (the token after the previous occurrence, key t - half + 1), and that every row
    t >= 1 puts on its previous token (key t - 1, what the layer below an induction head does)."""
    L = maps[0].shape[-1]
    t = torch.arange(half, L - 1, device=maps[0].device)
    r = torch.arange(1, L, device=maps[0].device)
    induction = [p[:, :, t, t - half + 1].float().mean(dim=(0, 2)) for p in maps]
    previous = [p[:, :, r, r - 1].float().mean(dim=(0, 2)) for p in maps]
    return induction, previous


@dataclasses.dataclass
class Snapshot:
    loss: float
    accuracy: float
    entropy: float          # mean row entropy (nats) of the ENTROPY_LAYER maps
    induction: list         # per layer, per head: head_scores' induction score
    previous: list          # per layer, per head: head_scores' previous-token score
    maps: list              # per layer, the first sequence's maps (heads, L, L), float32 on the CPU


@torch.no_grad()
def evaluate(model, ids, entropy_weight=ENTROPY_WEIGHT):
    logits, maps, _ = forward(model, ids)
    lg, tg = task_logits_targets(logits, ids)
    ce = nn.functional.cross_entropy(lg.flatten(0, 1).float(), tg.flatten())
    entropy = attention_entropy([maps[ENTROPY_LAYER]])
    induction, previous = head_scores(maps)
    return Snapshot(loss=(ce + entropy_weight * entropy).item(),
                    accuracy=(lg.argmax(-1) == tg).float().mean().item(), entropy=entropy.item(),
                    induction=[s.tolist() for s in induction], previous=[s.tolist() for s in previous],
                    maps=[p[0].float().cpu() for p in maps])


@dataclasses.dataclass
class Result:
    model: TinyLlama
    eval_ids: torch.Tensor
    before: Snapshot
    after: Snapshot
    history: list            # (step, loss, accuracy, entropy) of the training batches
    train_seconds: float


def train(device="cpu", steps=STEPS, batch=64, lr=1e-2, entropy_weight=ENTROPY_WEIGHT, seed=0, log=None,
          log_every=None, halves=HALVES, cfg=None):
    """Trains the demo model on the induction task; returns a Result. log(str) gets progress lines."""
    torch.manual_seed(seed)
    model = TinyLlama(cfg or demo_config()).to(device)
    data = torch.Generator().manual_seed(seed + 1)
    eval_ids = induction_batch(256, torch.Generator().manual_seed(seed + 2), device)
    before = evaluate(model, eval_ids, entropy_weight)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - 0.9 * s / max(1, steps)))
    log_every = log_every or max(1, steps // 8)
    history = []
    start = time.perf_counter()
    for step in range(steps + 1):
        half = int(torch.randint(halves[0], halves[1] + 1, (), generator=data))
        ids = induction_batch(batch, data, device, half=half)
        logits, maps, _ = forward(model, ids)
        lg, tg = task_logits_targets(logits, ids, half)
        ce = nn.functional.cross_entropy(lg.flatten(0, 1).float(), tg.flatten())
        entropy = attention_entropy([maps[ENTROPY_LAYER]])
        loss = ce + entropy_weight * entropy
        if step % log_every == 0 or step == steps:
            acc = (lg.argmax(-1) == tg).float().mean().item()
            history.append((step, loss.item(), acc, entropy.item()))
            if log:
                log(f"    step {step:4d}   loss {loss.item():.3f}   accuracy {acc:6.1%}   "
                    f"layer {ENTROPY_LAYER % len(model.blocks)} entropy {entropy.item():.3f}")
        if step == steps:
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    train_seconds = time.perf_counter() - start
    after = evaluate(model, eval_ids, entropy_weight)
    return Result(model, eval_ids, before, after, history, train_seconds)


def compare_with_math_op(model, ids):
    """Largest |O - O_math| and |P - P_math| over every layer, on the model's real q, k, v."""
    with torch.no_grad():
        _, _, qkvs = forward(model, ids, keep_qkv=True)
        err_o = err_p = 0.0
        for q, k, v in qkvs:
            o, p = sdpa_math.attention(q, k, v, is_causal=True, enable_gqa=True)
            o_n, p_n = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, enable_gqa=True)
            err_o = max(err_o, (o.float() - o_n.float()).abs().max().item())
            err_p = max(err_p, (p.float() - p_n.float()).abs().max().item())
    return err_o, err_p, qkvs[0][0].shape


def draw(res, out):
    """Before (top row) and after (bottom row) maps of layer 0's best previous-token head and
    layer 1's three best induction heads. Returns False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    a, b = res.after, res.before
    last = len(a.maps) - 1
    prev_head = max(range(len(a.previous[0])), key=lambda h: a.previous[0][h])
    ind_heads = sorted(range(len(a.induction[last])), key=lambda h: -a.induction[last][h])[:3]
    panels = [(0, prev_head, "previous"), *((last, h, "induction") for h in ind_heads)]
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 7.4))
    ids = res.eval_ids[0].tolist()
    for row, (snap, when) in enumerate(((b, "before"), (a, "after"))):
        for col, (layer, h, kind) in enumerate(panels):
            ax = axes[row, col]
            p = snap.maps[layer][h]
            ax.imshow(p.numpy() ** 0.5, cmap="magma", vmin=0, vmax=1, interpolation="nearest")
            score = (snap.previous if kind == "previous" else snap.induction)[layer][h]
            H = -(p * p.clamp_min(1e-30).log()).sum(-1).mean().item()
            ax.set_title(f"{when}: layer {layer} head {h}\n{kind} score {score:.2f}, H={H:.2f}", fontsize=9)
            ax.axhline(HALF - 0.5, color="w", lw=0.6, ls=":")
            ax.axvline(HALF - 0.5, color="w", lw=0.6, ls=":")
            ax.set_xlabel("key", fontsize=8)
            ax.set_ylabel("query", fontsize=8)
            ax.tick_params(labelsize=7)
    fig.suptitle(f"attention maps P returned by sdpa_math.attention (square-root colour scale) on "
                 f"{len(ids) // 2} distinct random tokens, then the same again\n(dotted: where the repeat starts; "
                 f"an induction head's query t attends to key t - {HALF - 1}, the token after the "
                 f"previous occurrence)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sdpa_math demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="sdpa_math_demo.png", help="where to write the maps before and after")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"training steps (batch 64; default {STEPS})")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    run(a.device, a.out, a.steps, a.seed)
    return 0


def run(device, out, steps=STEPS, seed=0, log=print):
    """The demo: trains, prints the summary through log, draws the PNG. Returns the Result, the
    errors against the math op (O, P) and the PNG's path (None without matplotlib)."""
    cfg = demo_config()
    name = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else "CPU"
    log(f"sdpa_math demo · {device} ({name}) · float32 · the induction task: n distinct random tokens (of "
        f"{VOCAB}), then the same n again (n = {HALVES[0]}..{HALVES[1]} in training, {HALF} in the evaluation); "
        f"predict each repeated token after the first")
    log(f"  TinyLlama, {cfg.layers} layers of {cfg.heads} query / {cfg.kv_heads} key-value heads (head dim "
        f"{cfg.head_dim}), attention by sdpa_math.attention; loss = cross-entropy + {ENTROPY_WEIGHT} x mean "
        f"row entropy of layer {cfg.layers - 1}'s maps P")
    log(f"  training {steps} steps of batch 64 (training-batch numbers):")
    res = train(device, steps=steps, seed=seed, log=log)
    b, af = res.before, res.after
    last = cfg.layers - 1
    log(f"  trained in {res.train_seconds:.1f} s ({steps / max(res.train_seconds, 1e-9):.0f} steps/s); "
        f"on {res.eval_ids.shape[0]} held-out sequences:")
    log(f"    task accuracy      before {b.accuracy:6.1%}   after {af.accuracy:6.1%}   (chance {1 / VOCAB:.1%})")
    log(f"    layer {last} entropy    before {b.entropy:6.3f}   after {af.entropy:6.3f}   nats per row")
    ind_h = max(range(cfg.heads), key=lambda h: af.induction[last][h])
    prev_h = max(range(cfg.heads), key=lambda h: af.previous[0][h])
    log(f"    induction head     layer {last} head {ind_h}: attention on the token after the previous "
        f"occurrence {b.induction[last][ind_h]:.2f} -> {af.induction[last][ind_h]:.2f}")
    log(f"    previous-token     layer 0 head {prev_h}: attention on the previous token "
        f"{b.previous[0][prev_h]:.2f} -> {af.previous[0][prev_h]:.2f}")
    err_o, err_p, shape = compare_with_math_op(res.model, res.eval_ids)
    log(f"  vs PyTorch's math op on the trained model's q, k, v (every layer, {tuple(shape)}): "
        f"max |O - O_math| = {err_o:.2e}   max |P - P_math| = {err_p:.2e}")
    path = pathlib.Path(out).resolve()
    if draw(res, path):
        log(f"  attention maps before (top) and after (bottom) training: {path}")
    else:
        path = None
        log("  (matplotlib is not installed: no picture; `pip install matplotlib`)")
    return res, (err_o, err_p), path
