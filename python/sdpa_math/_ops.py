"""Loads the compiled ops (torch.ops.sdpa_math.*) and registers their fake kernels for
torch.compile. Autograd through both outputs O and P comes with the compiled library
(csrc/autograd.cpp); double backward is not implemented: differentiating the gradients raises."""
from __future__ import annotations

import pathlib

import torch

_LIB = pathlib.Path(__file__).with_name("_C.so")
_REBUILD = "rebuild it against this one: `pip install --no-build-isolation .` in the sdpa_math source"


def build_info() -> dict[str, str]:
    """What the installed extension was built for (the build writes _build_info.py): TORCH_VERSION,
    CUDA_TOOLKIT ("" without CUDA), CUDA_ARCHITECTURES, CPU_LEVELS. Empty where no build wrote it."""
    try:
        from . import _build_info
    except ImportError:
        return {}
    return {k: v for k, v in vars(_build_info).items() if k.isupper()}


def _release(version: str) -> tuple[str, ...]:
    """(major, minor) of a PyTorch version: the C++ ABI an extension links against changes between
    them; "2.11.0+cu130" -> ("2", "11")."""
    return tuple(version.split("+")[0].split(".")[:2])


def _check_built_for(running: str) -> None:
    built = build_info().get("TORCH_VERSION")
    if built and _release(built) != _release(running):
        raise ImportError(f"sdpa_math was built for PyTorch {built}, but PyTorch {running} is installed; {_REBUILD}")


if not _LIB.exists():  # pragma: no cover - a broken install
    raise ImportError(f"sdpa_math: the compiled extension {_LIB} is missing; reinstall with "
                      "`pip install --no-build-isolation .`")
_check_built_for(torch.__version__)
try:
    torch.ops.load_library(str(_LIB))
except OSError as e:  # e.g. an undefined symbol: another PyTorch build than the one compiled against
    raise ImportError(f"sdpa_math: cannot load {_LIB} (built for PyTorch {build_info().get('TORCH_VERSION', '?')}, "
                      f"running {torch.__version__}): {e}; {_REBUILD}") from e

ops = torch.ops.sdpa_math


def _lead_shape(query, key, value, enable_gqa):
    """The output's leading dims (*batch, Hq): matmul broadcasting, GQA heads taking the query's.

    Shape inference only, for tracing with fake (possibly symbolic) shapes; the rule that
    validates and raises is the core's (src/core/validate.cpp), which every real call goes through."""
    ql, kl, vl = list(query.shape[:-2]), list(key.shape[:-2]), list(value.shape[:-2])
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3 and value.dim() >= 3:
        kl[-1] = ql[-1]
        vl[-1] = ql[-1]
    return torch.broadcast_shapes(tuple(ql), tuple(kl), tuple(vl))


@torch.library.register_fake("sdpa_math::forward")
def _forward_fake(query, key, value, attn_mask, dropout_p, is_causal, dropout_mask, scale, enable_gqa, rng):
    lead = _lead_shape(query, key, value, enable_gqa)
    L, S, Ev = query.shape[-2], key.shape[-2], value.shape[-1]
    return (
        query.new_empty((*lead, L, Ev)),
        query.new_empty((*lead, L, S)),
        query.new_empty((*lead, L), dtype=torch.float64 if query.dtype == torch.float64 else torch.float32),
    )


@torch.library.register_fake("sdpa_math::forward_stats")
def _forward_stats_fake(query, key, value, attn_mask, is_causal, scale, enable_gqa, col_sum, row_entropy, rows_first,
                        rows_count, rows_step):
    lead = _lead_shape(query, key, value, enable_gqa)
    L, S, Ev = query.shape[-2], key.shape[-2], value.shape[-1]
    stat = torch.float64 if query.dtype == torch.float64 else torch.float32
    return (
        query.new_empty((*lead, L, Ev)),
        query.new_empty((*lead, L), dtype=stat),
        query.new_empty((*lead, S) if col_sum else (0,), dtype=stat),
        query.new_empty((*lead, L) if row_entropy else (0,), dtype=stat),
        query.new_empty((*lead, rows_count, S) if rows_count > 0 else (0,)),
    )


@torch.library.register_fake("sdpa_math::kl_rows")
def _kl_rows_fake(reference, is_causal, query, ref_keys, logsumexp, scale):
    stat = torch.float64 if reference.dtype == torch.float64 else torch.float32
    rows = reference.shape[:-1]
    return reference.new_empty(rows, dtype=stat), reference.new_empty(rows, dtype=stat)


@torch.library.register_fake("sdpa_math::softmax_rows")
def _softmax_rows_fake(logits, dtype, is_causal, first, step):
    return logits.new_empty(logits.shape, dtype=dtype)


@torch.library.register_fake("sdpa_math::kl_forward")
def _kl_forward_fake(query, key, value, is_causal, scale, enable_gqa, logsumexp, reference):
    stat = torch.float64 if query.dtype == torch.float64 else torch.float32
    return logsumexp.new_empty(logsumexp.shape, dtype=stat), logsumexp.new_empty(logsumexp.shape, dtype=stat)


@torch.library.register_fake("sdpa_math::kl_backward")
def _kl_backward_fake(query, key, value, is_causal, scale, enable_gqa, logsumexp, reference, ref_row_sum, grad_kl,
                      output_mask):
    return (query.new_empty(query.shape if output_mask[0] else (0,)),
            key.new_empty(key.shape if output_mask[1] else (0,)))


@torch.library.register_fake("sdpa_math::backward")
def _backward_fake(grad_output, grad_probs, query, key, value, attn_mask, logsumexp, output, attn_probs, dropout_p, is_causal,
                   dropout_mask, scale, enable_gqa, rng, output_mask):
    # Gradients not asked for come back as empty (0,) tensors (see csrc/binding.cpp).
    mask_grad = output_mask[3] and attn_mask is not None and attn_mask.is_floating_point()
    return (
        query.new_empty(query.shape if output_mask[0] else (0,)),
        key.new_empty(key.shape if output_mask[1] else (0,)),
        value.new_empty(value.shape if output_mask[2] else (0,)),
        attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty((0,)),
    )


# Autograd of both ops (gradients through O and P; double backward an error) is registered in
# C++ (csrc/autograd.cpp): through Python it cost more host time than the kernel itself.

