"""What the benchmark times. `bench run`: each implementation maps (q, k, v, shape, scale, mask)
to (O, P), or O alone (flash), through Impls.call. `bench stats`: the statistics-only forward
(stats_impls) and the distillation term's forward + backward (kl_impls), by each way a user has."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import sdpa_math

from .shapes import Shape

aten_math = torch.ops.aten._scaled_dot_product_attention_math


def _repeat_kv(x, n):
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def _causal_hidden(q, k):
    """True where top-left causal attention hides key j from query i (j > i)."""
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)


def additive_mask(mask, dtype):
    """A bool mask as the float mask F.scaled_dot_product_attention hands to its math and
    efficient backends (0 where True, -inf where False); a float mask or None unchanged. The aten
    math op called directly would add a bool mask's 0/1 to the scores instead."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _apply_mask(scores, mask):
    if mask is None:
        return scores
    return scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def eager_attention(q, k, v, causal, scale, mask=None):
    """Attention as Hugging Face's eager path writes it: scores plus the mask, fp32 softmax,
    cast back, then P V."""
    g = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, g), _repeat_kv(v, g)
    scores = _apply_mask(torch.matmul(q, k.transpose(-1, -2)) * scale, mask)
    if causal:
        scores = scores.masked_fill(_causal_hidden(q, k), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v), probs


def _lse_then_probs(q, k, v, causal, scale, mask=None):
    g = q.shape[1] // k.shape[1]
    bias = additive_mask(mask, q.dtype)
    if q.is_cuda:
        # As F.scaled_dot_product_attention passes a mask to the efficient kernel: expanded to
        # (B, H, L, S) (a view).
        eb = None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, _repeat_kv(k, g), _repeat_kv(v, g), eb,
                                                                          True, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, _repeat_kv(k, g), _repeat_kv(v, g),
                                                                              0.0, causal, attn_mask=bias, scale=scale)
    scores = torch.matmul(q, _repeat_kv(k, g).transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        scores = scores.masked_fill(_causal_hidden(q, k), float("-inf"))
    # The fused kernels may pad lse's rows (to a multiple of 32 on CUDA).
    probs = torch.exp(scores - lse[..., : q.shape[-2]].float().unsqueeze(-1)).to(q.dtype)
    return out, probs


def _fused_sdpa(q, k, v, causal, scale, gqa, mask):
    """PyTorch's fused SDPA without P. With a mask FlashAttention does not apply, so on CUDA this
    is the memory-efficient kernel; it is held to the fused backends (never the math op) so that
    the column always means a fused kernel."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)


def compile_per_shape(fn):
    """torch.compile(fn) specialised to each shape and dtype. One graph per shape, dtype and grad
    mode: the recompile limit is raised so that no row silently falls back to eager (the default
    of 8 did that to the statistics rows after eight shapes)."""
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    return torch.compile(fn, dynamic=False)


class Impls:
    def __init__(self, device):
        self.device = device
        self._compiled = compile_per_shape(eager_attention)

    def names(self, dtype):
        names = ["ours", "override", "native"]
        if self.device == "cuda" and dtype in (torch.float16, torch.bfloat16):
            names.append("native16")
        return names + ["eager", "compiled", "lse", "flash"]

    def call(self, name, q, k, v, s: Shape, scale, mask=None):
        """Every implementation gets the same q, k, v (any layout) and mask. The aten op's
        callers (override, native, native16) get a bool mask as F.scaled_dot_product_attention
        would pass it on (`additive_mask`, converted inside the timed call); the others take it
        as it is."""
        gqa = s.Hq != s.Hkv
        if name == "ours":
            return sdpa_math.attention(q, k, v, attn_mask=mask, is_causal=s.causal, scale=scale, enable_gqa=gqa)
        if name == "override":
            with sdpa_math.override():
                return aten_math(q, k, v, additive_mask(mask, q.dtype), 0.0, s.causal, scale=scale, enable_gqa=gqa)
        if name == "native":
            return aten_math(q, k, v, additive_mask(mask, q.dtype), 0.0, s.causal, scale=scale, enable_gqa=gqa)
        if name == "native16":
            prev = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
            try:
                return aten_math(q, k, v, additive_mask(mask, q.dtype), 0.0, s.causal, scale=scale, enable_gqa=gqa)
            finally:
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(prev)
        if name == "eager":
            return eager_attention(q, k, v, s.causal, scale, mask)
        if name == "compiled":
            return self._compiled(q, k, v, s.causal, scale, mask)
        if name == "lse":
            return _lse_then_probs(q, k, v, s.causal, scale, mask)
        if name == "flash":
            return _fused_sdpa(q, k, v, s.causal, scale, gqa, mask)
        raise KeyError(name)


def _reduce_stats(P):
    """col_sum (Σ_i P) and row_entropy (−Σ P log P) of a map, in fp32, as a user writes them."""
    pf = P.float()
    return pf.sum(-2), -(pf * torch.log(torch.where(pf > 0, pf, torch.ones_like(pf)))).sum(-1)


def stats_impls(device):
    """name -> fn(q, k, v, s, scale): the statistics-only forward by each way a user has.
      ours     sdpa_math.stats.attention_stats (the fused operator: the CPU kernel, or on CUDA the
               Hopper kernel where it takes the inputs, else chunks)
      rows64   the same asked for P's last 64 rows only (SnapKV's window), no column sums or entropy
      chunks   the same with method="chunks" (chunks of P, each reduced and dropped)
      native   the math op's P, then the reductions
      compiled torch.compile of eager attention's P and the reductions (CUDA only: on the CPU its
               compile takes minutes per shape)
      kvwindow what kvpress's SnapKV press does today for its window (compute_window_attention):
               the layer's O from PyTorch's fused kernel, then the last 64 queries' map recomputed
               by hand (keys repeated per query head, a product, the causal mask, an fp32
               softmax): the route rows64 replaces
      flash    PyTorch's fused kernel without P or statistics: the speed of light
      colsum   flash-colsum's Triton column means (CUDA, where the package is installed: PyPI
               flash-colsum), the one other library that reduces P's columns without storing P;
               its statistic is the mean over heads and rows, its causal form takes batch 1 only
               (other rows record its error), and it has no GQA (keys repeated per head)"""
    from ..stats import attention_stats

    def ours(q, k, v, s, scale, method="auto"):
        return attention_stats(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv,
                               col_sum="per_head", row_entropy=True, method=method)

    def native(q, k, v, s, scale):
        _, P = aten_math(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
        return _reduce_stats(P)

    def eager_stats(q, k, v, causal, scale, n_rep):
        k, v = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
        scores = (q @ k.transpose(-2, -1)) * scale
        if causal:
            scores = scores.masked_fill(_causal_hidden(q, k), float("-inf"))
        P = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return P @ v, _reduce_stats(P)

    def rows64(q, k, v, s, scale):
        return attention_stats(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv,
                               rows=slice(-64, None))

    def kvwindow(q, k, v, s, scale):
        gqa = s.Hq != s.Hkv
        out = F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=gqa)
        w = min(64, q.shape[-2])
        scores = (q[..., -w:, :] @ _repeat_kv(k, s.Hq // s.Hkv).transpose(-2, -1)) * scale
        if s.causal:  # the window's own (w, S) mask: its row r is query L - w + r, hiding keys past it
            hidden = torch.ones(w, k.shape[-2], dtype=torch.bool, device=q.device).triu(q.shape[-2] - w + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        return out, torch.softmax(scores, dim=-1, dtype=torch.float32)

    impls = {"ours": ours, "rows64": rows64, "kvwindow": kvwindow,
             "chunks": lambda q, k, v, s, scale: ours(q, k, v, s, scale, method="chunks"),
             "native": native,
             "flash": lambda q, k, v, s, scale: F.scaled_dot_product_attention(
                 q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)}
    if device == "cuda":
        try:
            from flash_colsum import flash_colsum
        except ImportError:
            flash_colsum = None
        if flash_colsum is not None:
            impls["colsum"] = lambda q, k, v, s, scale: flash_colsum(
                q, _repeat_kv(k, s.Hq // s.Hkv), scale=scale, is_causal=s.causal)
        compiled = compile_per_shape(eager_stats)
        impls["compiled"] = lambda q, k, v, s, scale: compiled(q, k, v, s.causal, scale, s.Hq // s.Hkv)
    return impls


def kl_impls():
    """name -> fn(q, k, v, ref, s, scale): forward + backward of a distillation term, KL(ref ‖ P)
    per row summed, with its gradient to q and k (issue 16's `kl_to` target):
      ours     sdpa_math.stats.attention_stats(kl_to=ref) (on Hopper the fused kernels, P never
               formed; elsewhere chunks of P, each recomputed in the backward)
      native   the math op's P, the KL written as a user writes it, autograd through both
      flash    PyTorch's fused kernel forward + backward through O (no P, no KL): the speed of light"""
    from ..stats import attention_stats

    def ours(q, k, v, ref, s, scale):
        _, st = attention_stats(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv, kl_to=ref)
        return torch.autograd.grad(st["kl_to"].sum(), (q, k))

    def native(q, k, v, ref, s, scale):
        _, P = aten_math(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
        r, pf = ref.float(), P.float()
        kl = (torch.xlogy(r, r) - r * torch.log(torch.where(r > 0, pf, torch.ones_like(pf)))).sum(-1)
        return torch.autograd.grad(kl.sum(), (q, k))

    def flash(q, k, v, ref, s, scale):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=s.causal, scale=scale, enable_gqa=s.Hq != s.Hkv)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    return {"ours": ours, "native": native, "flash": flash}
