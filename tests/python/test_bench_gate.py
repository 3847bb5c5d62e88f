"""The performance gate's rules (sdpa_math.bench.gate) on small synthetic runs: what fails,
what warns and what passes. The harness itself runs in CI through scripts/gate_cpu.sh."""
import copy

from sdpa_math.bench import gate


def _run(native_ratio=2.0, floor_ratio=0.5, took=True, code="abc", device="cpu"):
    row = {"shape": "s1", "dtype": "float32",
           "impls": {"ours": {"fwd_ms": 1.0}, "override": {"override_took_call": took}, "native": {"fwd_ms": 2.0}},
           "speedup": {"fwd_ms": {"native": native_ratio, "floor": floor_ratio}}}
    return {"info": {"device": device, "code_hash": code}, "rows": [row]}


def test_same_ratios_pass():
    assert gate(_run(), _run(), 0.3, current_hash="abc") == ([], [])


def test_a_drop_past_the_threshold_fails_and_half_of_it_warns():
    fails, warns = gate(_run(native_ratio=1.3), _run(native_ratio=2.0), 0.3)
    assert len(fails) == 1 and "vs native" in fails[0] and not warns
    fails, warns = gate(_run(native_ratio=1.6), _run(native_ratio=2.0), 0.3)
    assert not fails and len(warns) == 1


def test_a_missing_row_fails():
    run = _run()
    run["rows"] = []
    fails, _ = gate(run, _run(), 0.3)
    assert fails == ["('s1', 'float32'): missing from the run"]


def test_a_stale_run_fails():
    fails, _ = gate(_run(code="old"), _run(), 0.3, current_hash="new")
    assert any("rerun" in f for f in fails)


def test_an_override_that_did_not_take_the_call_fails():
    fails, _ = gate(_run(took=False), _run(), 0.3)
    assert any("fell back" in f for f in fails)


def test_an_error_in_ours_and_another_device_profile_fail():
    run = _run(device="cuda")
    run["rows"][0]["impls"]["ours"] = {"error": "RuntimeError: boom"}
    fails, _ = gate(run, _run(), 0.3)
    assert any("device profile" in f for f in fails) and any("ours failed" in f for f in fails)


def test_a_ratio_the_baseline_has_but_the_run_lacks_fails():
    run = copy.deepcopy(_run())
    del run["rows"][0]["speedup"]["fwd_ms"]["floor"]
    fails, _ = gate(run, _run(), 0.3)
    assert fails == ["('s1', 'float32') fwd_ms vs floor: not measured"]


def test_a_row_the_baseline_lacks_is_new_not_a_failure():
    from sdpa_math.bench import new_rows
    run = _run()
    extra = copy.deepcopy(run["rows"][0])
    extra["shape"] = "s1_fmask"
    extra["speedup"]["fwd_ms"]["native"] = 0.01  # no baseline to judge it against
    run["rows"].append(extra)
    assert gate(run, _run(), 0.3) == ([], [])
    assert new_rows(run, _run()) == [("s1_fmask", "float32")]


def test_a_new_row_still_fails_on_an_error_in_ours():
    run = _run()
    extra = copy.deepcopy(run["rows"][0])
    extra["shape"] = "s1_kpad"
    extra["impls"]["ours"] = {"error": "RuntimeError: boom"}
    run["rows"].append(extra)
    fails, _ = gate(run, _run(), 0.3)
    assert fails == ["('s1_kpad', 'float32') (new): ours failed: RuntimeError: boom"]


def test_subset_judges_only_the_rows_the_run_has():
    baseline = _run()
    other = copy.deepcopy(baseline["rows"][0])
    other["shape"] = "s2"
    baseline["rows"].append(other)
    assert gate(_run(), baseline, 0.3) == (["('s2', 'float32'): missing from the run"], [])
    assert gate(_run(), baseline, 0.3, subset=True) == ([], [])


def _stats_run(native_ratio=10.0, x_flash=3.0, rows64_x_flash=2.0, fused=True, error=None):
    row = {"shape": "s1", "dtype": "float16", "fused": fused,
           "ms": {"ours": 0.3, "native": 3.0, "flash": 0.1},
           "errors": {"ours": error} if error else {},
           "speedup_vs_native": {"ours": native_ratio, "native": 1.0},
           "x_flash": {"ours": x_flash, "rows64": rows64_x_flash, "flash": 1.0}}
    return {"info": {"device": "cuda", "code_hash": "abc"}, "rows": [row]}


def test_statistics_rows_are_judged_by_their_own_ratios():
    assert gate(_stats_run(), _stats_run(), 0.3) == ([], [])
    # ours against the math op, and ours and rows64 against flash (flash / ours: higher is better)
    fails, _ = gate(_stats_run(native_ratio=6.0), _stats_run(), 0.3)
    assert fails == ["('s1', 'float16') stats vs native: 6.00x, baseline 10.00x"]
    fails, warns = gate(_stats_run(x_flash=4.0), _stats_run(), 0.3)  # 0.25 against 0.33: -25 %
    assert not fails and warns == ["('s1', 'float16') stats ours vs flash: 0.25x, baseline 0.33x"]
    fails, _ = gate(_stats_run(rows64_x_flash=4.0), _stats_run(), 0.3)
    assert fails == ["('s1', 'float16') stats rows64 vs flash: 0.25x, baseline 0.50x"]


def test_a_statistics_row_that_left_the_fused_kernel_or_failed_fails():
    fails, _ = gate(_stats_run(fused=False), _stats_run(), 0.3)
    assert fails == ["('s1', 'float16'): the fused statistics kernel no longer takes this row"]
    fails, _ = gate(_stats_run(error="RuntimeError: boom"), _stats_run(), 0.3)
    assert fails == ["('s1', 'float16'): ours failed: RuntimeError: boom"]


def test_an_override_that_failed_fails():
    run = _run()
    run["rows"][0]["impls"]["override"] = {"error": "RuntimeError: boom"}
    fails, _ = gate(run, _run(), 0.3)
    assert fails == ["('s1', 'float32'): the override failed: RuntimeError: boom"]


_XEON_AMX = """processor\t: 0
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16

processor\t: 1
cpu family\t: 6
model\t\t: 1
"""


def test_cpu_kind_reads_the_first_processor_and_the_isa_flags_that_matter():
    from sdpa_math.bench import cpu_kind
    assert cpu_kind(_XEON_AMX) == {"model": "6-167 Intel(R) Xeon(R) Processor",
                                   "isa": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]}
    assert cpu_kind("") is None


def test_another_kind_of_cpu_warns_and_an_unrecorded_one_does_not():
    from sdpa_math.bench import cpu_kind
    amx = cpu_kind(_XEON_AMX)
    avx2 = cpu_kind(_XEON_AMX.replace("model\t\t: 167", "model\t\t: 85").replace(" avx512f avx512_bf16 amx_tile amx_bf16", ""))
    run, base = _run(), _run()
    run["info"]["cpu_kind"], base["info"]["cpu_kind"] = amx, avx2
    fails, warns = gate(run, base, 0.3)
    assert not fails and len(warns) == 1 and "6-85" in warns[0] and "amx_tile" in warns[0]
    base["info"]["cpu_kind"] = copy.deepcopy(amx)
    assert gate(run, base, 0.3) == ([], [])
    del base["info"]["cpu_kind"]  # a baseline made before the field: nothing to compare
    assert gate(run, base, 0.3) == ([], [])
    # GPU runs are judged by their GPU's ratios: the host CPU does not warn
    run["info"]["device"] = base["info"]["device"] = "cuda"
    base["info"]["cpu_kind"] = avx2
    assert gate(run, base, 0.3) == ([], [])
