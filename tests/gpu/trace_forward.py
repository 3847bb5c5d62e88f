"""Where the Hopper forward's time goes, step by step: runs one shape on a trace build
(`-DSDPA_MATH_FWD_TRACE`, src/cuda/sm90/trace.cuh) and tables the median cycles of each step of a
tile, per pass, over the traced CTAs' middle tiles.

    python3 tests/gpu/trace_forward.py SHAPE [float16|bfloat16] [--raw FILE]   (run and table; keep the stamps)
    python3 tests/gpu/trace_forward.py --read FILE                            (table a kept file, no GPU)

SHAPE is one of forward_times.py's. On an ordinary build the kernel writes no stamps and this says
so. Cycles are the SM's own clock (clock64); ns from %globaltimer. Besides the per-step table:
the share of a CTA's time with a product of either warpgroup in flight, each product's duration
when the other warpgroup had none in flight and when it had, and one pass-2 stretch of CTA 5's
two warpgroups on their common clock.
"""
import os
import statistics
import struct
import sys
import tempfile

import numpy as np

# trace.cuh's step codes (the producer's, 1 and 2, are not tabled here)
START, END = 10, 30
P1 = {"top": 11, "kfull": 12, "turn": 13, "done": 14}
P2 = {"top": 21, "kfull": 22, "turn": 23, "done": 24, "written": 25, "vfull": 26, "pvturn": 27, "pvdone": 28,
      "pfree": 31, "staged": 32}


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"SDPAFWDT", "not a forward trace"
    ctas, roles, slots, grid = struct.unpack("4i", data[8:24])
    stamps = np.frombuffer(data, dtype=np.uint64, count=ctas * roles * slots, offset=24).reshape(ctas, roles, slots)
    info = np.frombuffer(data, dtype=np.uint64, count=ctas * 3, offset=24 + 8 * ctas * roles * slots).reshape(ctas, 3)
    return min(ctas, grid), stamps, info


def events(row):
    """[(code, cycle)] of one role's stamps, in order."""
    out = []
    for v in row:
        v = int(v)
        if v == 0:
            break
        out.append((v >> 56, v & ((1 << 56) - 1)))
    return out


def tiles_of(ev, codes):
    """Each tile of a pass as {step: cycle}, from its loop top on."""
    inv = {c: k for k, c in codes.items()}
    tiles = []
    for code, cyc in ev:
        if code == codes["top"]:
            tiles.append({})
        if code in inv and tiles:
            tiles[-1][inv[code]] = cyc
    return tiles


def run(shape, dtype_name):
    """Runs SHAPE once on the GPU with the stamps written to a file; returns its path or None."""
    import torch

    import sdpa_math
    from forward_times import SHAPES

    dtype = getattr(torch, dtype_name)
    B, Hq, Hkv, L, S, E, causal = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hq, L, E, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, S, E, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, S, E, device="cuda", dtype=dtype, generator=g)
    run = lambda: sdpa_math.attention(q, k, v, None, 0.0, causal, enable_gqa=Hq != Hkv)  # noqa: E731
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.bin")
    os.environ["SDPA_MATH_TRACE_FILE"] = path
    run()
    torch.cuda.synchronize()
    del os.environ["SDPA_MATH_TRACE_FILE"]
    return path if os.path.exists(path) else None


def products(stamps, c):
    """{role: [(issued, done, code)]} of CTA c's products, from their turn and done stamps."""
    out = {}
    for role in (1, 2):
        out[role], start = [], None
        for code, cyc in events(stamps[c, role]):
            if code in (P1["turn"], P2["turn"], P2["pvturn"]):
                start = (cyc, code)
            elif code in (P1["done"], P2["done"], P2["pvdone"]) and start is not None:
                out[role].append((start[0], cyc, start[1]))
                start = None
    return out


def overlap_tables(n, stamps):
    """The share of each CTA's consumer span with a product in flight, and product durations with
    the other warpgroup's products in flight or not (first 256 CTAs)."""
    busy, alone, together = [], {}, {}
    names = {P1["turn"]: "pass 1 S", P2["turn"]: "pass 2 S", P2["pvturn"]: "pass 2 u V"}
    for c in range(min(n, 256)):
        prods = products(stamps, c)
        ev = events(stamps[c, 1]) + events(stamps[c, 2])
        if not ev or not prods[1]:
            continue
        span = max(cy for _, cy in ev) - min(cy for _, cy in ev)
        merged, cur = 0, None
        for a, b, _ in sorted(prods[1] + prods[2]):
            if cur is None or a > cur[1]:
                merged += 0 if cur is None else cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        merged += cur[1] - cur[0]
        busy.append(merged / span)
        for role in (1, 2):
            for a, b, code in prods[role]:
                shared = any(min(b, y) > max(a, x) for x, y, _ in prods[3 - role])
                (together if shared else alone).setdefault(names[code], []).append(b - a)
    print(f"  a product in flight: {statistics.median(busy):.2f} of a CTA's consumer span (median over CTAs)")
    for name in names.values():
        a, t = alone.get(name, []), together.get(name, [])
        print(f"  {name:11s} issued -> done: alone {statistics.median(a) if a else float('nan'):6.0f} cycles (n {len(a)}), "
              f"beside the other warpgroup's {statistics.median(t) if t else float('nan'):6.0f} (n {len(t)})")


def timeline(stamps, c=5, rows=24):
    names = {START: "start", END: "end", **{v: "p1 " + k for k, v in P1.items()}, **{v: "p2 " + k for k, v in P2.items()}}
    ev = sorted((cyc, role, code) for role in (1, 2) for code, cyc in events(stamps[c, role]))
    tops = [i for i, (_, _, code) in enumerate(ev) if code == P2["top"]]
    if not tops:
        return
    k = tops[len(tops) // 2]
    print(f"  CTA {c}, a stretch of pass 2 (cycles from the CTA's first stamp):")
    for cyc, role, code in ev[k:k + rows]:
        print(f"    {cyc - ev[0][0]:7d} {'' if role == 1 else ' ' * 28}WG{role - 1} {names.get(code, code)}")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--read" in sys.argv:
        path, shape, dtype = sys.argv[sys.argv.index("--read") + 1], os.path.basename(sys.argv[-1]), "(kept)"
    else:
        shape, dtype = args[0], args[1] if len(args) > 1 else "float16"
        path = run(shape, dtype)
        if path is None:
            print("no trace written: not a trace build (-DSDPA_MATH_FWD_TRACE), or the call took another kernel")
            return
        if "--raw" in sys.argv:
            os.replace(path, sys.argv[sys.argv.index("--raw") + 1])
            path = sys.argv[sys.argv.index("--raw") + 1]
    n, stamps, info = read(path)

    steps1 = {"k wait": ("top", "kfull"), "turn wait": ("kfull", "turn"), "product": ("turn", "done")}
    steps2 = {"k wait": ("top", "kfull"), "turn wait": ("kfull", "turn"), "QK product": ("turn", "done"),
              "softmax + P": ("done", "written"), "  to P's buffer free": ("done", "pfree"),
              "  P staged": ("pfree", "staged"), "  P's store issued": ("staged", "written"),
              "v wait": ("written", "vfull"), "PV turn wait": ("vfull", "pvturn"), "PV product": ("pvturn", "pvdone")}
    acc1 = {k: [] for k in list(steps1) + ["softmax (to next top)", "tile"]}
    acc2 = {k: [] for k in list(steps2) + ["after PV (to next top)", "tile"]}
    cta_cycles, cta_ns, p1_total, p2_total = [], [], [], []
    for c in range(n):
        for role in (1, 2):
            ev = events(stamps[c, role])
            if not ev:
                continue
            t1, t2 = tiles_of(ev, P1), tiles_of(ev, P2)
            start = next(cy for code, cy in ev if code == START)
            end = next((cy for code, cy in ev if code == END), ev[-1][1])
            cta_cycles.append(end - start)
            if t1 and t2:
                p1_total.append(t2[0]["top"] - t1[0]["top"])
                p2_total.append(end - t2[0]["top"])
            for tiles, steps, acc, tail in ((t1, steps1, acc1, "softmax (to next top)"),
                                            (t2, steps2, acc2, "after PV (to next top)")):
                for i in range(1, len(tiles) - 1):  # middle tiles: no pipeline fill or drain
                    t = tiles[i]
                    for name, (a, b) in steps.items():
                        if a in t and b in t:  # a kernel variant may stamp fewer steps
                            acc[name].append(t[b] - t[a])
                    last = "done" if steps is steps1 else "pvdone"
                    if last in t:
                        acc[tail].append(tiles[i + 1]["top"] - t[last])
                    acc["tile"].append(tiles[i + 1]["top"] - t["top"])
        if info[c, 2] > info[c, 1]:
            cta_ns.append(int(info[c, 2] - info[c, 1]))
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    print(f"{shape} {dtype}: {n} CTAs traced, consumer warpgroups' median cycles")
    print(f"  whole warpgroup (Q arrived .. O stored): {med(cta_cycles):.0f}  pass 1: {med(p1_total):.0f}  "
          f"pass 2: {med(p2_total):.0f}  CTA wall (globaltimer): {med(cta_ns) / 1000:.2f} us")
    for title, acc in (("pass 1, per middle tile", acc1), ("pass 2, per middle tile", acc2)):
        print(f"  {title}:")
        for name, xs in acc.items():
            q = np.percentile(xs, [10, 50, 90]) if xs else [float("nan")] * 3
            print(f"    {name:24s} p10 {q[0]:7.0f}  median {q[1]:7.0f}  p90 {q[2]:7.0f}")
    sms = {}  # the CTAs each SM ran
    for c in range(n):
        sms.setdefault(int(info[c, 0]), []).append(c)
    per_sm = [len(v) for v in sms.values()]
    print(f"  CTAs per SM: min {min(per_sm)} max {max(per_sm)} over {len(sms)} SMs")
    t0 = min(int(info[c, 1]) for c in range(n))
    t1 = max(int(info[c, 2]) for c in range(n))
    print(f"  traced CTAs span {(t1 - t0) / 1000:.1f} us (globaltimer)")
    overlap_tables(n, stamps)
    timeline(stamps)


if __name__ == "__main__":
    main()
