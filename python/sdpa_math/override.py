"""The opt-in override: our kernels for aten::_scaled_dot_product_attention_math.

The aten op is CompositeImplicitAutograd. A kernel on the backend key (CPU) takes calls where no
input requires grad; with grad, the Autograd<Backend> key needs its own kernel, so both are
registered (shared/docs/design.md, "Override mechanics"). The torch.library.Library object holds
the registrations: it is kept here for as long as the override is on (a dropped handle would
silently unregister it).
"""
from __future__ import annotations

import contextlib
import threading

import torch

from .api import attention

_OP = "_scaled_dot_product_attention_math"


def _keys() -> tuple[str, ...]:
    """The dispatch keys to take over: CPU always, CUDA where this build has CUDA kernels."""
    keys = ["CPU", "AutogradCPU"]
    if torch._C._dispatch_has_kernel_for_dispatch_key("sdpa_math::forward", "CUDA"):
        keys += ["CUDA", "AutogradCUDA"]
    return tuple(keys)

_lock = threading.Lock()
_library: torch.library.Library | None = None
_interceptions = 0


def _aten_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, dropout_mask=None, *,
                 scale=None, enable_gqa=False):
    global _interceptions
    _interceptions += 1
    return attention(query, key, value, attn_mask, dropout_p, is_causal, dropout_mask, scale=scale,
                     enable_gqa=enable_gqa)


def enable() -> None:
    """Route aten::_scaled_dot_product_attention_math (and F.scaled_dot_product_attention under
    the math backend) to sdpa_math on CPU tensors, and on CUDA tensors when this build has the
    CUDA backend. Idempotent."""
    global _library
    with _lock:
        if _library is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        for key in _keys():
            lib.impl(_OP, _aten_kernel, key)
        _library = lib


def disable() -> None:
    """Restore PyTorch's own kernels. Idempotent."""
    global _library
    with _lock:
        if _library is None:
            return
        _library._destroy()
        _library = None


def is_enabled() -> bool:
    return _library is not None


@contextlib.contextmanager
def override():
    """`with sdpa_math.override(): ...` enables the override for the block, then restores the
    previous state."""
    was_enabled = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()


def interceptions() -> int:
    """How many aten calls the override has taken since the process started."""
    return _interceptions
