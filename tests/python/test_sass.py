"""The Hopper forward and backward are built from Hopper's own instructions: their sm_90a machine
code in the installed extension holds warpgroup products (HGMMA, not the mma.sync HMMA) and TMA
loads (and stores), and keeps the unmasked forward's and every backward's registers out of local
memory.

Runs wherever the extension was built with the CUDA backend for 90a (CI builds it: nvcc is there),
with cuobjdump from the CUDA toolkit or the copy Triton ships; no GPU needed.
"""
import pathlib
import re
import shutil
import subprocess

import pytest

import sdpa_math


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def _extension():
    return next(pathlib.Path(sdpa_math.__file__).parent.glob("_C*.so"))


@pytest.fixture(scope="module")
def sm90_functions():
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or Triton)")
    listing = subprocess.run([tool, "-lelf", str(_extension())], capture_output=True, text=True)
    if "forward_sm90" not in listing.stdout:
        pytest.skip("the extension has no Hopper forward (built without CUDA or without 90a)")
    # Only the sm_90a code, read as a stream keeping the Hopper kernels' blocks: the whole
    # listing is close to a gigabyte of text.
    functions, name, body = {}, None, []
    with subprocess.Popen([tool, "-sass", "-arch", "sm_90a", str(_extension())], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as proc:
        for line in proc.stdout:
            header = line.strip()
            if header.startswith("Function : "):
                if name:
                    functions[name] = "".join(body)
                fn = header[len("Function : "):].strip()
                name, body = (fn, []) if ("forward_sm90" in fn or "backward_sm90" in fn) else (None, [])
            elif name:
                body.append(line)
    assert proc.returncode == 0, f"cuobjdump -sass exited {proc.returncode}"
    if name:
        functions[name] = "".join(body)
    return functions


@pytest.fixture(scope="module")
def sm90_backward(sm90_functions):
    # The kernel itself, not its helpers (whose mangled names hold the file's, backward_sm90_cu).
    return {n: b for n, b in sm90_functions.items() if re.search(r"\d+backward_sm90I", n)}


@pytest.fixture(scope="module")
def sm90_forward(sm90_functions):
    """(forward kernels storing P by TMA, forward kernels copying P out, statistics kernels):
    forward_sm90<T, D, MASK, STATS, P_COPY> by its last two template arguments (the mangled name's
    Lb0 / Lb1 pairs), not its helpers (stats_columns)."""
    kernels = {n: b for n, b in sm90_functions.items() if re.search(r"\d+forward_sm90I", n)}
    return tuple({n: b for n, b in kernels.items() if tag in n} for tag in ("ELb0ELb0E", "ELb0ELb1E", "ELb1ELb0E"))


def test_every_sm90_forward_kernel_uses_hgmma_and_tma(sm90_forward):
    by_tma, by_copy, stats = sm90_forward
    # fp16/bf16 x head 64/128 x no mask, bool, same dtype, fp32; the same for P's copy-out and for
    # the statistics form
    assert len(by_tma) == 16 and len(by_copy) == 16 and len(stats) == 16
    for name, body in {**by_tma, **by_copy, **stats}.items():
        assert re.search(r"\bHGMMA\.64x128x16\.F32", body), name
        assert "UTMALDG" in body, name
        assert not re.search(r"\bHMMA\b", body), name
    for name, body in by_tma.items():  # P leaves by TMA stores (the statistics kernels keep it)
        assert "UTMASTG" in body, name
    for name, body in by_copy.items():  # or from shared memory by the warpgroup's 8-byte stores
        assert "UTMASTG" not in body and re.search(r"\bLDS\.64\b", body) and "STG.E.64" in body, name


def test_unmasked_sm90_forward_keeps_registers_out_of_local_memory(sm90_forward):
    # MaskKind 0 (no mask) is the anchors' kernel: a spill there costs every unmasked call. (The
    # statistics kernels are not held to it: their column sums' registers push the head-128 one
    # past its 232 registers.)
    unmasked = {n: b for kind in sm90_forward[:2] for n, b in kind.items() if "MaskKindE0E" in n}
    assert len(unmasked) == 8
    for name, body in unmasked.items():
        assert not re.search(r"\b(LDL|STL)\b", body), name


def test_no_sm90_kernel_has_its_warpgroup_products_serialised(sm90_functions):
    # When ptxas cannot prove a product's registers safe while it runs (a non-wgmma write of an
    # accumulator, a product issued on a divergent path: its C7515/C7518 notes), it waits for each
    # product before the next (a WARPGROUP.DEPBAR after every HGMMA) and the kernel runs at a
    # fraction of its speed, with correct results. Unserialised, a wait ends a whole group of them.
    kernels = {n: b for n, b in sm90_functions.items() if re.search(r"\d+(forward|backward)_sm90I", n)}
    assert len(kernels) == 60  # 32 forward (P by TMA, P copied), 16 statistics, 12 backward
    for name, body in kernels.items():
        products = len(re.findall(r"\bHGMMA\.", body))
        waits = len(re.findall(r"\bWARPGROUP\.DEPBAR\b", body))
        assert products >= 8 and waits * 2 <= products, f"{name}: {waits} waits for {products} products"


def test_every_sm90_backward_kernel_uses_hgmma_tma_and_vector_reductions(sm90_backward):
    assert len(sm90_backward) == 12  # fp16/bf16 x head 64/128 x with dO, without, kl_to's form
    for name, body in sm90_backward.items():
        # dK += dSᵀ Q reads dS transposed from shared memory; dQ's partial sums leave as 16-byte
        # reductions; no mma.sync and no local memory.
        assert re.search(r"\bHGMMA\.64x(64|128)x16\.F32[^\n]*tnspA", body), name
        assert "UTMALDG" in body and "REDG.E.ADD.F32x4" in body, name
        assert not re.search(r"\bHMMA\b", body), name
        assert not re.search(r"\b(LDL|STL)\b", body), name
