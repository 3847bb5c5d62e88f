"""sdpa_math: exact attention returning the output O and the full probability map P, with
gradients through both (the contract of aten::_scaled_dot_product_attention_math)."""
from . import _ops  # noqa: F401  (loads the compiled ops and registers autograd and fake kernels)
from .api import attention, attention_with_lse
from .override import disable, enable, interceptions, is_enabled, override

__version__ = "0.1.0"
__all__ = ["attention", "attention_with_lse", "enable", "disable", "override", "interceptions", "is_enabled"]
