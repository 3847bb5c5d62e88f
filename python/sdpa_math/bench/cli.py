"""Side-by-side benchmark of attention that returns P, and the performance gate.

    python -m sdpa_math.bench run  [--device cpu|cuda] [--set NAME] [--dtypes ...] [--out DIR]
    python -m sdpa_math.bench gate RUN.json BASELINE.json [--threshold F] [--subset]
    python -m sdpa_math.bench stats [--device cpu|cuda] [--set NAME] [--dtypes ...] [--out DIR]

`run` times, in one process and on one device, forward (O, P) and forward+backward through both
outputs (random dO and dP) of:
  ours      sdpa_math.attention
  override  aten::_scaled_dot_product_attention_math under sdpa_math.enable() (checks that the
            override really took the call)
  native    aten::_scaled_dot_product_attention_math, default settings
  native16  the same with fp16/bf16 reduction allowed (CUDA, fp16/bf16 only)
  eager     attention as Hugging Face models write it (fp32 softmax)
  compiled  torch.compile of `eager`
  lse       O and log-sum-exp from PyTorch's fused kernel, then P = exp(scale QK^T + mask - lse)
  flash     PyTorch's fused kernel without P: the speed of light, not a competitor
On CUDA a sample is the GPU time of one call (`--timing gpu`, the default): a spin kernel queued
first keeps the GPU busy while the host issues the call, as in a program that keeps its GPU fed;
the host's time to issue each call is reported beside it. `--timing wall` times a call issued to
an idle GPU instead, host time included.
It measures the machine's ceilings in the same run (a large copy, a large matrix product), gives
each shape's roofline floor and the fraction of it reached, the peak extra device memory and the
relative error of O and P against a float64 reference, and writes bench.json (every raw number,
the machine and software), bench.md (tables) and, for a sweep, speedup.png.

Sets (`--set`): the GPU anchors, the CPU set, CI's set, a sweep of lengths, and the input
variants real models pass (`variants`: a (B, 1, L, S) float mask, a (B, 1, 1, S) key-padding
bool mask, q/k/v as transposed views of (B, L, H, E); rows named `<base>_fmask`, `<base>_kpad`,
`<base>_blhe`), alone with their base row or appended to the anchors (`anchors+variants`) or the
CPU set (`cpu+variants`).

`stats` times the statistics-only forward (column sums and row entropy per head, no gradient) of
sdpa_math.stats.attention_stats against the same statistics from the math op's P, from compiled
eager attention (CUDA) and flash attention's forward without P, with each one's error against
float64; it writes stats.json and stats.md (issue 16).

`gate` compares a run with a committed baseline of the same device profile and prints
`FAIL n · WARN n` (and `NEW n` for rows the baseline lacks, which it does not judge): it judges
same-run ratios only (ours against native, ours against the floor), never absolute times across
runs.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from . import timing
from .baseline import gate, new_rows
from .implementations import Impls, stats_impls
from .provenance import code_hash, machine_info
from .report import markdown, plot, stats_markdown, write_json
from .run_rows import run_row
from .shapes import MASKED_VARIANTS, SETS
from .stats_rows import run_stats_row
from .timing import ceilings


def _setup(a, default_sets):
    """What `run` and `stats` share: the device, the set's shapes (default_sets: (cuda, cpu)),
    the dtypes, the output folder (made), and the timing method."""
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SETS[a.set or default_sets[device != "cuda"]](device)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    timing.TIMING = a.timing
    return device, shapes, [getattr(torch, d) for d in a.dtypes], out


def _cmd_stats(a):
    device, shapes, dtypes, out = _setup(a, ("anchors", "cpu"))
    masked = [s.name for s in shapes if s.variant in MASKED_VARIANTS]
    if masked:  # the statistics rows pass no mask (yet): a masked row would be mislabelled
        raise SystemExit(f"bench stats: rows with a mask are not supported here: {', '.join(masked)}")
    impls = stats_impls(device)
    run = {"info": {**machine_info(device), "device": device, "timing": timing.TIMING if device == "cuda" else "wall"},
           "rows": []}
    for s in shapes:
        for dtype in dtypes:
            row = run_stats_row(impls, s, dtype, device, a.reps)
            run["rows"].append(row)
            print(f"{s.name:24s} {row['dtype']:9s} ours {row['ms'].get('ours', float('nan')):8.3f} ms  "
                  f"x native {row['speedup_vs_native'].get('ours', float('nan')):5.2f}", flush=True)
            write_json(run, out / "stats.json")
    (out / "stats.md").write_text(stats_markdown(run))
    print(f"wrote {out / 'stats.json'}, {out / 'stats.md'}")


def _cmd_run(a):
    device, shapes, dtypes, out = _setup(a, ("anchors+sweep", "cpu+sweep"))
    impls = Impls(device)
    ceil = ceilings(device)
    run = {"info": {**machine_info(device), "timing": timing.TIMING if device == "cuda" else "wall"},
           "ceilings": ceil, "rows": []}
    for s in shapes:
        for dtype in dtypes:
            t0 = time.perf_counter()
            row = run_row(impls, s, dtype, device, ceil, a.reps, with_backward=not a.no_backward)
            run["rows"].append(row)
            sp = row["speedup"].get("fwd_ms", {})
            print(f"{s.name:24s} {row['dtype']:9s} fwd x native {sp.get('native', float('nan')):6.2f}  "
                  f"x floor {sp.get('floor', float('nan')):5.2f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
            write_json(run, out / "bench.json")
    (out / "bench.md").write_text(markdown(run))
    png = plot(run, out / "speedup.png")
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {png}" if png else ""))


def _cmd_gate(a):
    run = json.loads(pathlib.Path(a.run).read_text())
    baseline = json.loads(pathlib.Path(a.baseline).read_text())
    fails, warns = gate(run, baseline, a.threshold, None if a.no_hash_check else code_hash(), subset=a.subset)
    new = new_rows(run, baseline)
    for f in fails:
        print("FAIL", f)
    for w in warns:
        print("WARN", w)
    for key in new:
        print("NEW ", f"{key}: new, no baseline (ratios not judged)")
    print(f"FAIL {len(fails)} · WARN {len(warns)}" + (f" · NEW {len(new)}" if new else ""))
    return 1 if fails else 0


# The input dtypes the benchmark times (--dtypes): argparse names a wrong one before anything runs.
BENCH_DTYPES = ("float16", "bfloat16", "float32")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m sdpa_math.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time every implementation side by side")
    r.add_argument("--device", choices=["cpu", "cuda"])
    r.add_argument("--set", choices=sorted(SETS))
    r.add_argument("--dtypes", nargs="+", choices=BENCH_DTYPES, default=list(BENCH_DTYPES), metavar="DTYPE",
                    help="space-separated, of " + ", ".join(BENCH_DTYPES))
    r.add_argument("--reps", type=int, default=15)
    r.add_argument("--no-backward", action="store_true")
    r.add_argument("--timing", choices=["gpu", "wall"], default="gpu",
                   help="CUDA samples: GPU time with the host's issuing hidden behind a spin kernel (gpu), or "
                        "a call issued to an idle GPU, host time included (wall)")
    r.add_argument("--out", default="bench-out")
    st = sub.add_parser("stats", help="time the statistics-only forward (col_sum + row_entropy) side by side")
    st.add_argument("--device", choices=["cpu", "cuda"])
    st.add_argument("--set", choices=sorted(SETS))
    st.add_argument("--dtypes", nargs="+", choices=BENCH_DTYPES, default=list(BENCH_DTYPES), metavar="DTYPE",
                    help="space-separated, of " + ", ".join(BENCH_DTYPES))
    st.add_argument("--reps", type=int, default=10)
    st.add_argument("--timing", choices=["gpu", "wall"], default="gpu")
    st.add_argument("--out", default="bench-out")
    g = sub.add_parser("gate", help="compare a run with a committed baseline")
    g.add_argument("run")
    g.add_argument("baseline")
    g.add_argument("--threshold", type=float, default=0.35,
                   help="allowed drop of a same-run ratio below the baseline's (CPU noise is ~20%%)")
    g.add_argument("--no-hash-check", action="store_true", help="do not require the run to match this tree")
    g.add_argument("--subset", action="store_true",
                   help="judge only the baseline's rows the run has (e.g. an anchors+variants run against an "
                        "anchors+sweep baseline); without it a baseline row missing from the run FAILs")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        _cmd_run(a)
        return 0
    if a.cmd == "stats":
        _cmd_stats(a)
        return 0
    return _cmd_gate(a)
