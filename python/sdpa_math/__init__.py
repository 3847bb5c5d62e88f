"""sdpa_math: exact attention returning the output O and the full probability map P, with
gradients through both (the contract of aten::_scaled_dot_product_attention_math)."""
import torch

from . import _ops  # noqa: F401  (loads the compiled ops and registers autograd and fake kernels)
from .api import attention, attention_with_lse
from .explain import explain
from .override import disable, enable, interceptions, is_enabled, override
from . import stats  # noqa: F401  (sdpa_math.stats.attention_stats: statistics of P without holding it)

__version__ = "0.1.0"
__all__ = ["attention", "attention_with_lse", "explain", "enable", "disable", "override", "interceptions", "is_enabled",
           "cpu_isa", "cpu_isas_available", "set_cpu_isa"]


def cpu_isa() -> str:
    """The instruction-set level of the CPU kernels in use: "avx512", "avx2" or "baseline".

    The kernels are built once per level and the best one this CPU runs is chosen at the first
    CPU call, unless the environment variable SDPA_MATH_CPU_ISA names a lower one."""
    return torch.ops.sdpa_math.cpu_isa()


def cpu_isas_available() -> list[str]:
    """The levels this build has and this CPU can run, best first."""
    return torch.ops.sdpa_math.cpu_isas_available().split(", ")


def set_cpu_isa(level: str) -> None:
    """Runs the CPU kernels of `level` from now on (one of cpu_isas_available(); RuntimeError
    otherwise): to compare levels, or to test the portable path on a machine that has more."""
    torch.ops.sdpa_math.set_cpu_isa(level)
