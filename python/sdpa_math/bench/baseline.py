"""The performance gate: a run against a committed baseline of the same device profile. It judges
same-run ratios only (ours against native, ours against the floor), never absolute times across
runs."""
from __future__ import annotations

from .provenance import CPU_ISA_FLAGS


def new_rows(run, baseline):
    """(shape, dtype) of the run's rows that the baseline does not have: reported as new, with no
    ratio to judge (an older baseline predates them)."""
    have = {(b["shape"], b["dtype"]) for b in baseline["rows"]}
    return [(r["shape"], r["dtype"]) for r in run["rows"] if (r["shape"], r["dtype"]) not in have]


def is_stats_row(row):
    """A row of `bench stats` (statistics of P), not of `bench run`."""
    return "x_flash" in row


def judged_ratios(row):
    """The same-run ratios the gate judges in a row, by name; higher is better. `bench run` rows:
    ours against the math op and against the floor, forward and forward + backward. `bench stats`
    rows: the statistics forward against the math op's P and its reductions, ours and rows64
    against flash attention's forward (flash time / ours), and kl_to's forward + backward against
    flash attention's."""
    if is_stats_row(row):
        out = {}
        if row.get("speedup_vs_native", {}).get("ours") is not None:
            out["stats vs native"] = row["speedup_vs_native"]["ours"]
        for name in ("ours", "rows64"):
            if row.get("x_flash", {}).get(name):
                out[f"stats {name} vs flash"] = 1.0 / row["x_flash"][name]
        if row.get("kl_fwdbwd", {}).get("x_flash"):
            out["kl_to fwd+bwd vs flash"] = 1.0 / row["kl_fwdbwd"]["x_flash"]
        return out
    return {f"{phase} vs {against}": v for phase in ("fwd_ms", "fwdbwd_ms") for against in ("native", "floor")
            if (v := row.get("speedup", {}).get(phase, {}).get(against)) is not None}


def _row_problems(row):
    """Reasons a row fails without a baseline: an error in ours, or (bench run) an override that
    did not take the aten call."""
    if is_stats_row(row):
        return [f"ours failed: {row['errors']['ours']}"] if "ours" in row.get("errors", {}) else []
    ours, ov = row["impls"].get("ours", {}), row["impls"].get("override", {})
    if "error" in ours:
        return [f"ours failed: {ours['error']}"]
    if ov and "error" in ov:
        return [f"the override failed: {ov['error']}"]
    if ov and not ov.get("override_took_call", False):
        return ["the override did not take the aten call (fell back to native)"]
    return []


def gate(run, baseline, threshold, current_hash=None, subset=False):
    """Returns (fails, warns), lists of reasons. A row of the baseline missing from the run, a
    run that measured other code than the tree's, an override that did not take its call, an
    error in ours, or a statistics row that the fused kernel ran in the baseline and not in the
    run, is a FAIL; a same-run ratio (`judged_ratios`) below the baseline's by more than
    `threshold` is a FAIL, by more than half of it a WARN. Rows of the run that the baseline lacks
    (`new_rows`) have no ratios to judge; an error in ours or an override that did not take its
    call there still FAILs, as neither needs a baseline. With `subset`, a baseline row missing
    from the run is not judged (a run of some of the baseline's sets). A CPU run on another kind of
    CPU than the baseline's (`cpu_kind`: model or ISA extensions differ, where both runs record
    it) is a WARN: its ratios can shift with the machine alone. The same rules hold for `bench run`
    and `bench stats` runs (each against a baseline of its own kind)."""
    fails, warns = [], []
    kinds = run["info"].get("cpu_kind"), baseline["info"].get("cpu_kind")
    if run["info"].get("device") == "cpu" and None not in kinds and kinds[0] != kinds[1]:
        def text(k):
            return f"{k.get('model')}, {' '.join(k.get('isa') or []) or 'none of ' + ' '.join(CPU_ISA_FLAGS)}"
        warns.append(f"the run's CPU ({text(kinds[0])}) is not the baseline's ({text(kinds[1])}): its ratios can "
                     "shift with the machine alone; a baseline made on this kind of CPU judges it")
    by_base = {(b["shape"], b["dtype"]) for b in baseline["rows"]}
    for r in run["rows"]:
        key = (r["shape"], r["dtype"])
        if key in by_base:
            continue
        fails += [f"{key} (new): {why}" for why in _row_problems(r)]
    if run["info"].get("device") != baseline["info"].get("device"):
        fails.append(f"device profile {run['info'].get('device')} is not the baseline's {baseline['info'].get('device')}")
    if current_hash is not None and run["info"].get("code_hash") != current_hash:
        fails.append(f"the run measured code {run['info'].get('code_hash')}, the tree is {current_hash}: rerun")
    by_key = {(r["shape"], r["dtype"]): r for r in run["rows"]}
    for b in baseline["rows"]:
        key = (b["shape"], b["dtype"])
        r = by_key.get(key)
        if r is None:
            if not subset:
                fails.append(f"{key}: missing from the run")
            continue
        problems = _row_problems(r)
        fails += [f"{key}: {why}" for why in problems]
        if problems and problems[0].startswith("ours failed"):
            continue
        if is_stats_row(b) and b.get("fused") and not r.get("fused"):
            fails.append(f"{key}: the fused statistics kernel no longer takes this row")
        got_ratios = judged_ratios(r)
        for name, base in judged_ratios(b).items():
            got = got_ratios.get(name)
            if got is None:
                fails.append(f"{key} {name}: not measured")
            elif got < base * (1 - threshold):
                fails.append(f"{key} {name}: {got:.2f}x, baseline {base:.2f}x")
            elif got < base * (1 - threshold / 2):
                warns.append(f"{key} {name}: {got:.2f}x, baseline {base:.2f}x")
    return fails, warns
