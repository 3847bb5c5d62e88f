#!/usr/bin/env python3
"""Compare the machine code (SASS) of CUDA kernels between two builds, per kernel.

For checking that a refactoring (moving code between files, splitting a kernel into inlined
device functions) leaves each kernel's instruction mix as it was. Python 3 standard library only;
needs cuobjdump (and uses c++filt, when on PATH, to demangle names).

  sass_compare.py summarize OBJ_OR_SO... [--cuobjdump PATH] [--strip NS]... > summary.json
      Runs `cuobjdump -res-usage` and `cuobjdump -sass` on the files and records, per kernel:
      registers, shared memory, stack, local memory, the instruction count and the count of each
      opcode (the instruction's first token without predicate or modifiers: HGMMA, MUFU, FFMA,
      LDS, STG, BAR, SYNCS, ...). Kernel names are demangled and namespace components that a
      split may move kernels between are dropped ("(anonymous namespace)::" always, and each
      --strip NS, default "fwd"), so that the same kernel has the same name in both builds.

  sass_compare.py compare BEFORE.json AFTER.json [--strict-opcodes OP,...]
      One line per kernel: registers and instruction totals before -> after, and the opcodes
      whose counts differ; then the kernels only one side has, and a verdict line. Exits 1 when
      a kernel of BEFORE is missing from AFTER, or a kernel's registers or count of an opcode in
      --strict-opcodes (default HGMMA,MUFU) changed (with --strict-stack, its stack frame too);
      else 0. A changed stack frame (spills: see the LDL/STL counts) is always flagged "stack".

Example (a refactoring of src/cuda/sm90/forward_sm90.cu; the flags are CMake's for sdpa_math_sm90,
one compile at a time on a small machine):
  FLAGS="-std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -lineinfo -Xcompiler=-fPIC
         -gencode=arch=compute_90a,code=sm_90a -I include"
  mkdir -p /tmp/old/src/cuda/sm90 && git show BASE:src/cuda/sm90/forward_sm90.cu > /tmp/old/src/cuda/sm90/forward_sm90.cu
  nvcc $FLAGS -I src/cuda/sm90 -I src/cuda -c /tmp/old/src/cuda/sm90/forward_sm90.cu -o /tmp/old/fwd.o
  for f in src/cuda/sm90/forward_sm90*.cu; do nvcc $FLAGS -c $f -o /tmp/new/$(basename $f .cu).o; done
  scripts/sass_compare.py summarize /tmp/old/fwd.o > before.json
  scripts/sass_compare.py summarize /tmp/new/*.o > after.json
  scripts/sass_compare.py compare before.json after.json
(CUOBJDUMP in the environment, or --cuobjdump, names the tool when it is not on PATH, e.g. the
copy Triton ships under triton/backends/nvidia/bin/.)
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

DEFAULT_CUOBJDUMP = "cuobjdump"
INSN_RE = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(.*?)\s*;")
FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)")
RES_FUNC_RE = re.compile(r"^\s*Function\s+(\S+?):?\s*$")
RES_KV_RE = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")


def run(cmd):
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr}")
    return res.stdout


def demangle_all(names):
    """Mangled -> demangled, through one c++filt call (names unchanged without c++filt)."""
    names = sorted(set(names))
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names) + "\n", stdout=subprocess.PIPE, text=True).stdout
    lines = out.split("\n")
    return {n: (lines[i] if i < len(lines) and lines[i] else n) for i, n in enumerate(names)}


def strip_params(name):
    """'void ns::k<A, (E)3>(int, float)' -> 'ns::k<A, (E)3>': drops the return type and the
    parameter list (the first '(' outside template brackets after the name has begun)."""
    if name.startswith("void "):
        name = name[5:]
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def normalise(demangled, strip):
    name = strip_params(demangled.replace("(anonymous namespace)::", ""))
    for ns in strip:
        name = re.sub(r"(?<![A-Za-z0-9_])" + re.escape(ns) + r"::", "", name)
    return name


def opcode_of(text):
    toks = text.split()
    while toks and toks[0].startswith("@"):  # predicate guard
        toks = toks[1:]
    if not toks:
        return None
    return toks[0].split(".")[0]


def summarize_file(path, cuobjdump):
    """{mangled: {...}} for every kernel of one object or library."""
    kernels = {}
    current = None
    for line in run([cuobjdump, "-res-usage", path]).splitlines():
        m = RES_FUNC_RE.match(line)
        if m:
            current = m.group(1)
            kernels.setdefault(current, {"file": os.path.basename(path), "opcodes": Counter(), "instructions": 0})
            continue
        if current and "REG:" in line:
            for k, v in RES_KV_RE.findall(line):
                kernels[current][k.lower()] = int(v)
            current = None
    current = None
    for line in run([cuobjdump, "-sass", path]).splitlines():
        m = FUNC_RE.match(line)
        if m:
            current = m.group(1)
            kernels.setdefault(current, {"file": os.path.basename(path), "opcodes": Counter(), "instructions": 0})
            continue
        if current is None:
            continue
        m = INSN_RE.match(line)
        if m:
            op = opcode_of(m.group(1))
            if op:
                kernels[current]["opcodes"][op] += 1
                kernels[current]["instructions"] += 1
    return kernels


def cmd_summarize(args):
    raw = {}
    for path in args.files:
        for mangled, info in summarize_file(path, args.cuobjdump).items():
            raw[mangled] = info
    names = demangle_all(raw)
    strip = args.strip if args.strip else ["fwd"]
    out = {}
    for mangled, info in raw.items():
        key = normalise(names[mangled], strip)
        if key in out:
            key = f"{key} [{mangled}]"  # two kernels that normalise alike: keep both
        entry = {
            "mangled": mangled,
            "file": info["file"],
            "registers": info.get("reg"),
            "shared": info.get("shared"),
            "stack": info.get("stack"),
            "local": info.get("local"),
            "instructions": info["instructions"],
            "opcodes": dict(sorted(info["opcodes"].items())),
        }
        out[key] = entry
    json.dump(dict(sorted(out.items())), sys.stdout, indent=1)
    sys.stdout.write("\n")


def short(name, width=110):
    return name if len(name) <= width else name[: width - 3] + "..."


def cmd_compare(args):
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    strict = [s for s in args.strict_opcodes.split(",") if s]
    failures = []
    stack_notes = []
    same_mix = 0
    tot_b = tot_a = 0
    for name in sorted(before):
        b = before[name]
        if name not in after:
            print(f"MISSING  {short(name)}")
            failures.append(f"missing: {name}")
            continue
        a = after[name]
        tot_b += b["instructions"]
        tot_a += a["instructions"]
        ops = sorted(set(b["opcodes"]) | set(a["opcodes"]))
        diffs = [(op, b["opcodes"].get(op, 0), a["opcodes"].get(op, 0)) for op in ops]
        diffs = [d for d in diffs if d[1] != d[2]]
        bad = []
        if b.get("registers") != a.get("registers"):
            bad.append("registers")
        stack_changed = b.get("stack") != a.get("stack")
        if stack_changed:
            stack_notes.append(name)
            if args.strict_stack:
                bad.append("stack")
        bad += [op for op, x, y in diffs if op in strict]
        if not diffs:
            same_mix += 1
        tag = "FAIL" if bad else ("same" if not diffs else ("diff" if not stack_changed else "stack"))
        diff_text = " ".join(f"{op} {x}->{y}" for op, x, y in diffs) if diffs else "same opcode counts"
        print(
            f"{tag:4}  {short(name)}\n"
            f"      regs {b.get('registers')}->{a.get('registers')} stack {b.get('stack')}->{a.get('stack')}"
            f" insts {b['instructions']}->{a['instructions']} ({a['instructions'] - b['instructions']:+d}): {diff_text}"
        )
        if bad:
            failures.append(f"{name}: {', '.join(bad)} changed")
    extra = sorted(set(after) - set(before))
    for name in extra:
        print(f"NEW      {short(name)}")
    common = len(before) - sum(1 for f in failures if f.startswith("missing: "))
    print(
        f"TOTAL    kernels before {len(before)}, after {len(after)}, compared {common}, "
        f"identical opcode counts {same_mix}/{common}; instructions {tot_b} -> {tot_a} ({tot_a - tot_b:+d})"
    )
    if stack_notes:
        print(f"STACK    {len(stack_notes)} kernel(s) with another stack frame (see their LDL/STL counts)")
    if failures:
        print(f"VERDICT  FAIL: {len(failures)} problem(s): " + "; ".join(short(f, 200) for f in failures[:10]))
        return 1
    print(
        "VERDICT  OK: every kernel present, registers and "
        + "/".join(strict)
        + " counts unchanged"
        + ("" if same_mix == common else f" ({common - same_mix} kernel(s) with other opcode count differences)")
    )
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="per-kernel resources and opcode counts as JSON on stdout")
    s.add_argument("files", nargs="+")
    s.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP", DEFAULT_CUOBJDUMP))
    s.add_argument("--strip", action="append", help="a namespace component to drop from names (repeatable; default fwd)")
    c = sub.add_parser("compare", help="compare two summaries")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--strict-opcodes", default="HGMMA,MUFU")
    c.add_argument("--strict-stack", action="store_true", help="fail on a changed stack frame as well")
    args = ap.parse_args()
    if args.cmd == "summarize":
        cmd_summarize(args)
        return 0
    return cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main())
