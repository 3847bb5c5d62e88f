"""Which code and machine a run measured: the sources' hash, the CPU's kind (model and ISA
extensions, which move the CPU gate's ratios), and the run's machine info."""
from __future__ import annotations

import datetime
import hashlib
import pathlib
import platform

import torch

import sdpa_math


def code_hash():
    """Hash of the sources that decide what is measured (the C++/CUDA core, the binding and the
    Python package), taken from the source tree this module was imported from when it is one,
    else from the installed package files."""
    base = pathlib.Path(__file__).resolve().parents[3]  # python/sdpa_math/bench/ -> the tree's root
    files = []
    if (base / "src").is_dir() and (base / "python" / "sdpa_math").is_dir():
        for sub in ("src", "include", "python/sdpa_math"):
            files += [p for p in (base / sub).rglob("*") if p.is_file() and p.suffix in
                      (".h", ".cuh", ".cpp", ".cu", ".py", ".txt")]
    else:  # an installed package: its Python files and the compiled extension
        base = pathlib.Path(__file__).resolve().parents[1]  # the sdpa_math package
        files = [p for p in base.rglob("*.py")] + [p for p in base.glob("_C*.so")]
    h = hashlib.sha256()
    for p in sorted(files):  # paths relative to the tree: the same code hashes alike in any checkout
        h.update(str(p.relative_to(base)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


# x86 extensions that move the CPU gate's ratios: our kernels and torch's products use them
# differently (a machine with AVX-512 and AMX ran torch's fp32 products about twice as fast as
# one without, and every CPU ratio fell by about half; bench/NOTES.md).
CPU_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_kind(cpuinfo: str | None = None):
    """The CPU as the gate compares it: {"model": "family-model name", "isa": the CPU_ISA_FLAGS it
    has}, from /proc/cpuinfo's first processor (or the text given); None where there is none
    (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = pathlib.Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block ends
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    if not fields:
        return None
    flags = set(fields.get("flags", "").split())
    model = f"{fields.get('cpu family', '?')}-{fields.get('model', '?')} {fields.get('model name', '')}".strip()
    return {"model": model, "isa": [f for f in CPU_ISA_FLAGS if f in flags]}


def machine_text(info) -> str:
    """The machine of a run's info for a report: the GPU's name, else the CPU's kind (model and ISA
    extensions) where recorded, else the architecture."""
    if info.get("gpu"):
        return info["gpu"]
    kind = info.get("cpu_kind")
    if kind:
        return f"{kind['model']} ({', '.join(kind['isa']) or 'no AVX2'})"
    return info.get("cpu", "?")


def machine_info(device):
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
            "cpu": platform.processor() or platform.machine(), "cpu_kind": cpu_kind(),
            "threads": torch.get_num_threads(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "code_hash": code_hash(), "sdpa_math": getattr(sdpa_math, "__version__", "?")}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info
