"""The harness's statistics rows (`python -m sdpa_math.bench stats`): every way it times gives
the same column sums and row entropy, a row records times, errors against float64 and ratios,
and the report renders. One tiny row on the CPU; the timings themselves are not judged here."""
import json

import pytest
import torch

from sdpa_math import bench
from sdpa_math.bench import Shape, make_inputs

TINY = Shape("tiny", 2, 4, 2, 24, 40, 8)
TINY_CAUSAL = Shape("tiny_causal", 1, 2, 2, 32, 32, 8, True)


def test_every_cpu_way_gives_the_same_statistics():
    impls = bench.stats_impls("cpu")
    assert set(impls) == {"ours", "rows64", "kvwindow", "chunks", "native", "flash"}  # compiled: CUDA only
    for s in (TINY, TINY_CAUSAL):
        q, k, v, _ = make_inputs(s, torch.float32, "cpu")
        scale = s.D ** -0.5
        ref = bench.attention_stats_reference(q, k, v, s, scale)
        with torch.no_grad():
            for name in ("ours", "chunks", "native"):
                res = impls[name](q, k, v, s, scale)
                cs, ent = (res[1]["col_sum"], res[1]["row_entropy"]) if isinstance(res[1], dict) else res
                torch.testing.assert_close(cs.double(), ref[0], rtol=1e-5, atol=1e-6, msg=name)
                torch.testing.assert_close(ent.double(), ref[1], rtol=1e-5, atol=1e-6, msg=name)
            _, P = bench.aten_math(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
            _, st = impls["rows64"](q, k, v, s, scale)  # L < 64 here: every row
            torch.testing.assert_close(st["rows"], P[..., -64:, :], rtol=1e-5, atol=1e-6)


def test_a_row_and_its_report(tmp_path):
    impls = bench.stats_impls("cpu")
    row = bench.run_stats_row(impls, TINY, torch.bfloat16, "cpu", reps=3)
    assert set(row["ms"]) == {"ours", "rows64", "kvwindow", "chunks", "native", "flash"} and not row["errors"]
    assert row["fused"] is True  # the CPU operator takes every input
    assert all(t > 0 for t in row["ms"].values())
    # bf16 inputs: the fused operator reduces fp32 rows of P; the others reduce P rounded to bf16
    assert max(row["rel_err"]["ours"].values()) <= 1e-5
    assert max(row["rel_err"]["native"].values()) > 1e-5
    assert row["speedup_vs_native"]["native"] == 1.0
    kl = row["kl_fwdbwd"]  # the distillation term's forward + backward, each way timed
    assert set(kl["ms"]) == {"ours", "native", "flash"} and not kl["errors"] and kl["x_flash"] > 0
    run = {"info": {**bench.machine_info("cpu"), "timing": "wall"}, "rows": [row]}
    json.dumps(run)
    md = bench.stats_markdown(run)
    assert "| tiny | bfloat16 | yes |" in md and md.count("\n|") == 6
    assert "| tiny | bfloat16 | " + f"{kl['ms']['ours']:.3f}" in md


def test_every_kl_way_gives_the_same_gradients():
    s = TINY_CAUSAL
    q, k, v, _ = make_inputs(s, torch.float64, "cpu")
    scale = s.D ** -0.5
    _, ref = bench.aten_math(torch.randn_like(q), k, v, is_causal=True, scale=scale)
    grads = {}
    for name in ("ours", "native"):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        grads[name] = bench.kl_impls()[name](*leaves, ref, s, scale)
    for a, b in zip(grads["ours"], grads["native"]):
        torch.testing.assert_close(a, b)
    assert grads["ours"][0].abs().max() > 0


def test_kvpress_window_column_computes_the_rows_ours_gives():
    """The kvwindow column (kvpress's hand-recomputed SnapKV window) times the same 64 rows of P as
    rows64, with a causal mask and GQA, so the two columns compare like for like."""
    impls = bench.stats_impls("cpu")
    for s in (Shape("gqa_causal", 1, 4, 2, 80, 80, 8, True), TINY):
        q, k, v, _ = make_inputs(s, torch.float32, "cpu")
        scale = s.D ** -0.5
        o_kv, window = impls["kvwindow"](q, k, v, s, scale)
        o_ours, st = impls["rows64"](q, k, v, s, scale)
        torch.testing.assert_close(window, st["rows"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(o_kv, o_ours, atol=1e-5, rtol=1e-5)


def test_flash_colsum_column_is_the_mean_of_our_column_sums():
    """The colsum column (flash-colsum, CUDA only, where installed) times a statistic ours gives
    too: its column means are our per-head column sums averaged over heads and rows."""
    if not torch.cuda.is_available():
        pytest.skip("flash-colsum runs on CUDA only")
    pytest.importorskip("flash_colsum")
    s = Shape("gqa", 2, 4, 2, 128, 128, 64)
    q, k, v, _ = make_inputs(s, torch.float16, "cuda")
    impls = bench.stats_impls("cuda")
    got = impls["colsum"](q, k, v, s, s.D ** -0.5)
    _, st = impls["ours"](q, k, v, s, s.D ** -0.5)
    torch.testing.assert_close(got.float(), st["col_sum"].mean(1) / s.L, rtol=2e-2, atol=1e-4)
