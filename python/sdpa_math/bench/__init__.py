"""Side-by-side benchmark of attention that returns P, and the performance gate:
`python -m sdpa_math.bench run|stats|gate ...` (the command line and its documentation: cli).

The modules, one job each:
  shapes           the rows' shapes, the named sets (`--set`), the input variants, a row's inputs
  implementations  what is timed: ours, the math op, eager, compiled, lse, flash; the statistics
                   and KL forms of `bench stats`
  timing           the interleaved timing method, peak memory, the measured ceilings, the floors
  run_rows         one row of `bench run`
  stats_rows       one row of `bench stats`
  provenance       which code and machine a run measured
  report           bench.json / bench.md / speedup.png, stats.json / stats.md
  baseline         the gate: a run against a committed baseline
  cli              the command line

Every name below is importable from sdpa_math.bench as it was from the single module before.
timing.TIMING, the CUDA sampling method, is a setting of the timing module: set it there
(sdpa_math.bench.TIMING reads it)."""
from . import timing
from .baseline import gate, is_stats_row, judged_ratios, new_rows
from .cli import BENCH_DTYPES, main
from .implementations import (Impls, additive_mask, aten_math, compile_per_shape, eager_attention, kl_impls,
                              stats_impls)
from .provenance import CPU_ISA_FLAGS, code_hash, cpu_kind, machine_info, machine_text
from .report import (COLUMNS, KL_COLUMNS, STATS_COLUMNS, VARIANT_TARGET, host_markdown, markdown, plot,
                     stats_markdown, variants_markdown, write_json)
from .run_rows import run_row
from .shapes import (ANCHORS, CI_SET, CPU_SET, MASKED_VARIANTS, SETS, VARIANTS, Shape, make_inputs, sweep,
                     variant_base, variants, variants_of)
from .stats_rows import attention_stats_reference, run_kl, run_stats_row
from .timing import ceilings, floor_ms, interleaved_ms, median_ms, output_bytes, peak_extra_bytes

__all__ = ["ANCHORS", "BENCH_DTYPES", "CI_SET", "COLUMNS", "CPU_ISA_FLAGS", "CPU_SET", "Impls", "KL_COLUMNS",
           "MASKED_VARIANTS", "SETS", "STATS_COLUMNS", "Shape", "VARIANTS", "VARIANT_TARGET", "additive_mask",
           "aten_math", "attention_stats_reference", "ceilings", "code_hash", "compile_per_shape", "cpu_kind",
           "eager_attention", "floor_ms", "gate", "host_markdown", "interleaved_ms", "is_stats_row",
           "judged_ratios", "kl_impls", "machine_info", "machine_text", "main", "make_inputs", "markdown",
           "median_ms", "new_rows", "output_bytes", "peak_extra_bytes", "plot", "run_kl", "run_row",
           "run_stats_row", "stats_impls", "stats_markdown", "sweep", "variant_base", "variants",
           "variants_markdown", "variants_of", "write_json"]


def __getattr__(name):
    if name == "TIMING":  # the timing module's current setting, not a copy taken at import
        return timing.TIMING
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
