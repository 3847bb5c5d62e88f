"""sdpa_math.explain against docs/design.md's "Routes by example" table (so the table cannot go
stale), the reasons paths give, the command line, and that explaining leaves inputs untouched.
The CUDA rows also check that the op really runs on the route explain names where a kernel's
name shows in the profiler."""
import pathlib
import re

import pytest
import torch

import sdpa_math
from sdpa_math.__main__ import main as cli_main

DESIGN = pathlib.Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _table_rows():
    text = DESIGN.read_text()
    section = text.split("### Routes by example", 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`"):
            continue
        rows.append(tuple([cells[0].strip("`")] + cells[1:]))
    return rows


ROWS = _table_rows()


def test_the_design_table_is_read():
    assert len(ROWS) >= 10
    assert {r[1] for r in ROWS} == {"cpu", "cuda", "hopper"}


def _hopper():
    return (torch.cuda.is_available() and torch.ops.sdpa_math.built_with_cuda()
            and torch.cuda.get_device_capability() == (9, 0) and "90a" in sdpa_math._ops.build_info().get(
                "CUDA_ARCHITECTURES", ""))


def _problem(spec, device):
    tokens = spec.split()
    sizes = dict(t.split("=") for t in tokens if "=" in t)
    flags = {t for t in tokens if "=" not in t}
    dtype = next(getattr(torch, f) for f in flags if f in ("float16", "bfloat16", "float32", "float64"))
    B, H, L, S, E = (int(sizes[n]) for n in ("B", "H", "L", "S", "E"))
    Hkv = int(sizes.get("gqa", H))
    q = torch.randn(B, H, L, E, dtype=dtype, device=device)
    k, v = (torch.randn(B, Hkv, S, E, dtype=dtype, device=device) for _ in range(2))
    mask = None
    if "mask" in sizes:
        mdt = {"bool": torch.bool, "float32": torch.float32}.get(sizes["mask"], dtype)
        mask = torch.zeros(B, 1, L, S, dtype=mdt, device=device)
    return q, k, v, mask, float(sizes.get("dropout", 0.0)), "causal" in flags, Hkv != H


@pytest.mark.parametrize("spec,device,forward,backward,statistics", ROWS, ids=[r[0] for r in ROWS])
def test_route_matches_the_design_table(spec, device, forward, backward, statistics):
    if device == "hopper" and not _hopper():
        pytest.skip("needs an sm_90a build on a Hopper GPU")
    if device == "cuda" and not (torch.cuda.is_available() and torch.ops.sdpa_math.built_with_cuda()):
        pytest.skip("needs a CUDA build and GPU")
    q, k, v, mask, dropout_p, causal, gqa = _problem(spec, "cpu" if device == "cpu" else "cuda")
    stats = bool(statistics)
    e = sdpa_math.explain(q, k, v, mask, dropout_p, causal, enable_gqa=gqa, col_sum=stats, row_entropy=stats)
    assert (e.forward.kernel, e.backward.kernel) == (forward, backward), str(e)
    if stats:
        assert e.stats.kernel == statistics, str(e)
    # Every path before the chosen one gave a reason; the chosen one is not among the decliners.
    assert all(why for _, why in e.forward.declined + e.backward.declined)
    assert forward not in [p for p, _ in e.forward.declined]


def test_cpu_routes_and_the_float64_reason():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    e = sdpa_math.explain(q, q, q)
    assert e.forward.kernel == "reference" and e.forward.why_not("cpu").startswith("float64")
    e32 = sdpa_math.explain(q.float(), q.float(), q.float(), backward=False)
    assert e32.forward.kernel == "cpu" and e32.backward is None and e32.stats is None


def test_bad_inputs_get_the_operators_own_error():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="head"):
        sdpa_math.explain(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reasons_name_the_problem():
    q = torch.randn(2, 4, 256, 64, dtype=torch.float16, device="cuda")
    e = sdpa_math.explain(q, q, q, None, 0.1)
    assert e.forward.why_not("decode") == "more than 4 query rows"
    if _hopper():
        assert e.forward.why_not("sm90") == "dropout" and e.backward.why_not("sm90") == "dropout"
    # A transposed view the TMA unit cannot address (rows of 63 halves: not 16-byte aligned).
    odd = torch.randn(2, 4, 256, 63, dtype=torch.float16, device="cuda")
    e = sdpa_math.explain(odd, odd, odd)
    assert e.forward.kernel == "sm80"
    if _hopper():
        assert re.search("multiple of 8", e.forward.why_not("sm90"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_op_runs_the_kernel_explain_names():
    """The profiler's kernel names carry each path's namespace or kernel name."""
    cases = [((2, 4, 1, 2048, 128), torch.float16, "decode", "decode"),
             ((2, 4, 256, 256, 64), torch.float32, "cublas-fp32", "gemm")]
    if _hopper():
        cases.append(((2, 4, 256, 256, 128), torch.float16, "sm90", "sm90"))
    for (B, H, L, S, E), dtype, kernel, marker in cases:
        q = torch.randn(B, H, L, E, dtype=dtype, device="cuda")
        k, v = (torch.randn(B, H, S, E, dtype=dtype, device="cuda") for _ in range(2))
        assert sdpa_math.explain(q, k, v, backward=False).forward.kernel == kernel
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sdpa_math.attention(q, k, v)
            torch.cuda.synchronize()
        names = " ".join(e.name for e in prof.events()).lower()
        assert marker in names, (kernel, names[:500])


def test_command_line(capsys):
    assert cli_main(["explain", "--shape", "1,2,16,16,32", "--dtype", "float32", "--device", "cpu",
                     "--stats", "col_sum,rows"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "forward: cpu" and "backward: cpu" in out and "statistics: cpu" in out
    with pytest.raises(SystemExit):
        cli_main(["explain", "--shape", "1,2,16", "--device", "cpu"])
