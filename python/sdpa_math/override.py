"""The opt-in override: our kernels for aten::_scaled_dot_product_attention_math.

The aten op is CompositeImplicitAutograd. A kernel on the backend key (CPU) takes calls where no
input requires grad; with grad, the Autograd<Backend> key needs its own kernel, so both are
registered (docs/design.md, "Override mechanics"). The torch.library.Library object holds
the registrations: it is kept here for as long as the override is on (a dropped handle would
silently unregister it).

Thread safety: the registration is process-wide; enable()/disable() and the override() blocks of
every thread change one reference-counted state under a lock (see override()), and the
interception counter is updated under a lock.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .api import attention

_OP = "_scaled_dot_product_attention_math"


def _keys() -> tuple[str, ...]:
    """The dispatch keys to take over: CPU always, CUDA where this build has CUDA kernels."""
    keys = ["CPU", "AutogradCPU"]
    if torch.ops.sdpa_math.built_with_cuda():
        keys += ["CUDA", "AutogradCUDA"]
    return tuple(keys)

# The registration is process-wide (the dispatcher has no per-thread kernels), so the state that
# decides it is too, and every change to it happens under _lock: the aten kernels are ours while
# enable() is in force or at least one override() block, in any thread, is running.
_lock = threading.Lock()
_library: torch.library.Library | None = None
_enabled = False       # enable() called and not undone by disable()
_blocks = 0            # override() blocks running now, all threads, nested ones counted each
_count_lock = threading.Lock()
_interceptions = 0


def _aten_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, dropout_mask=None, *,
                 scale=None, enable_gqa=False):
    global _interceptions
    if torch.are_deterministic_algorithms_enabled() and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, attn_mask)):
        # Our backward adds some gradients in a varying order (and refuses deterministic mode,
        # see binding.cpp); the math op's own composition is deterministic, so code that ran
        # under torch.use_deterministic_algorithms(True) keeps running. Not counted.
        return torch.ops.aten._scaled_dot_product_attention_math.default.decompose(
            query, key, value, attn_mask, dropout_p, is_causal, dropout_mask, scale=scale, enable_gqa=enable_gqa)
    with _count_lock:
        _interceptions += 1
    return attention(query, key, value, attn_mask, dropout_p, is_causal, dropout_mask, scale=scale,
                     enable_gqa=enable_gqa)


def _sync() -> None:
    """Registers or drops the kernels to match (_enabled, _blocks). Called with _lock held."""
    global _library
    want = _enabled or _blocks > 0
    if want and _library is None:
        lib = torch.library.Library("aten", "IMPL")
        for key in _keys():
            lib.impl(_OP, _aten_kernel, key)
        _library = lib
    elif not want and _library is not None:
        _library._destroy()
        _library = None


def enable() -> None:
    """Route aten::_scaled_dot_product_attention_math (and F.scaled_dot_product_attention under
    the math backend) to sdpa_math on CPU tensors, and on CUDA tensors when this build has the
    CUDA backend, in the whole process, until disable(). Idempotent, thread-safe."""
    global _enabled
    with _lock:
        _enabled = True
        _sync()


def disable() -> None:
    """Undo enable(): PyTorch's own kernels are back once no override() block is running either
    (a block in another thread keeps the override on until it exits). Idempotent, thread-safe."""
    global _enabled
    with _lock:
        _enabled = False
        _sync()


def is_enabled() -> bool:
    """Whether the aten op goes to sdpa_math now (enable() in force, or an override() block running)."""
    with _lock:
        return _library is not None


@contextlib.contextmanager
def override() -> Iterator[None]:
    """`with sdpa_math.override(): ...` routes the aten op to sdpa_math for the block.

    The dispatcher's kernels are process-wide, so the override is too: while the block runs, calls
    from every thread are taken. Blocks are reference-counted under a lock, across threads and
    nested ones alike: leaving a block restores PyTorch's kernels only when no other block (in this
    or another thread) is still running and enable() is not in force, so one thread leaving its
    block never turns the override off under another thread still inside one. enable() or
    disable() called inside a block set the state that holds after the last block exits."""
    global _blocks
    with _lock:
        _blocks += 1
        try:
            _sync()
        except BaseException:
            _blocks -= 1
            raise
    try:
        yield
    finally:
        with _lock:
            _blocks -= 1
            _sync()


def interceptions() -> int:
    """How many aten calls the override has taken since the process started (counted under a
    lock: exact with calls from several threads)."""
    with _count_lock:
        return _interceptions
