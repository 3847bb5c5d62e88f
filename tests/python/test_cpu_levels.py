"""The CPU kernels at every instruction-set level this machine runs (src/cpu/isa.h): the fuzz
test's seeded problems, forward and backward against the math op in float64, with each level
chosen in turn — so the portable (baseline) path is tested on a machine that has AVX-512 too.
(tests/cpp runs the C++ suite on emulated CPUs without AVX-512 and without AVX.)"""
import random

import pytest
import torch

import sdpa_math
from test_fuzz import DEVICE_DTYPES, check_problem, draw_case

LEVELS = sdpa_math.cpu_isas_available()


@pytest.fixture
def restore_level():
    before = sdpa_math.cpu_isa()
    yield
    sdpa_math.set_cpu_isa(before)


def test_levels_are_listed_best_first_and_the_best_is_the_default():
    assert LEVELS[-1] == "baseline"
    order = ["avx512", "avx2", "baseline"]
    assert LEVELS == sorted(LEVELS, key=order.index)
    # The test process may lower the level on purpose (SDPA_MATH_CPU_ISA); otherwise the best runs.
    import os
    assert sdpa_math.cpu_isa() == (os.environ.get("SDPA_MATH_CPU_ISA") or LEVELS[0])


@pytest.mark.parametrize("level", LEVELS)
def test_level_matches_the_math_op(level, restore_level, monkeypatch):
    monkeypatch.setenv("SDPA_MATH_POISON_OUTPUTS", "1")
    sdpa_math.set_cpu_isa(level)
    assert sdpa_math.cpu_isa() == level
    rng = random.Random(7)
    for n in range(40):
        case = draw_case(rng)
        dtype = rng.choice(DEVICE_DTYPES["cpu"][:1] + DEVICE_DTYPES["cpu"][2:])  # float64 skips the kernels
        try:
            check_problem(case, dtype, seed=n, device="cpu")
        except AssertionError as e:
            raise AssertionError(f"{level} problem {n}: {case} {dtype}: {e}") from e


def test_unknown_level_is_refused_and_changes_nothing(restore_level):
    before = sdpa_math.cpu_isa()
    with pytest.raises(RuntimeError, match=r"CPU kernel level 'avx1024' is not available here; this build and CPU have: "
                                           + ", ".join(LEVELS)):
        sdpa_math.set_cpu_isa("avx1024")
    assert sdpa_math.cpu_isa() == before
    q = torch.randn(1, 2, 3, 8)
    out, probs = sdpa_math.attention(q, q, q)
    assert torch.allclose(probs.sum(-1), torch.ones(1, 2, 3))
