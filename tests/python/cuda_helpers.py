"""What the CUDA test files share: the Hopper skip mark, the names of the kernels a call launches,
(B, H, N, E) inputs and masks in the layouts and forms models pass, and the float64 reference."""
import pytest
import torch

sm90_only = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                               reason="needs an sm_90 (Hopper) GPU")
HALF_DTYPES = [torch.float16, torch.bfloat16]


def dtype_id(d):
    return str(d).split(".")[-1]


def cuda_kernels(fn):
    """Runs fn under the profiler; returns (its result, the names of the CUDA kernels it launched)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def make(shape, dtype, layout, gen, requires_grad=False):
    """(B, H, N, E) values on the GPU; 'blhe' makes them as a (B, N, H, E) tensor viewed as
    (B, H, N, E), as Hugging Face attention modules pass them. With requires_grad: leaves."""
    if layout == "blhe":
        b, h, n, e = shape
        x = torch.randn(b, n, h, e, generator=gen, device="cuda").to(dtype).transpose(1, 2)
    else:
        x = torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    return x.detach().requires_grad_() if requires_grad else x


def make_mask(kind, B, H, L, S, dtype, gen):
    """A mask of the given kind for (B, H, L, S) scores, or None for 'none'."""
    if kind == "none":
        return None
    if kind == "float_b1ls":  # Hugging Face's padding mask: 0 or the dtype's min, row 3 all masked
        keep = torch.rand(B, 1, L, S, generator=gen, device="cuda") < 0.8
        keep[:, :, 3] = False
        return torch.zeros(B, 1, L, S, device="cuda", dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    if kind == "float_full":
        return torch.randn(B, H, L, S, generator=gen, device="cuda").to(dtype)
    if kind == "float32_b1ls":  # an fp32 mask on fp16/bf16 inputs
        return torch.randn(B, 1, L, S, generator=gen, device="cuda")
    if kind == "float_ls":
        return torch.randn(L, S, generator=gen, device="cuda").to(dtype)
    if kind == "bool_keypad":  # (B, 1, 1, S): the last keys of each batch padded
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool, device="cuda")
        for b in range(B):
            keep[b, ..., S - 7 * (b + 1):] = False
        return keep
    if kind == "bool_full":
        keep = torch.rand(B, H, L, S, generator=gen, device="cuda") < 0.7
        keep[:, :, 5] = False  # fully masked rows: P = O = 0, lse = -inf
        return keep
    raise ValueError(kind)


def reference(q, k, v, mask, causal, scale, gqa):
    """float64 on the GPU, straight from the definition; rows with no visible key give P = O = 0."""
    q, k, v = q.double(), k.double(), v.double()
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * scale
    L, S = s.shape[-2:]
    visible = torch.ones(L, S, dtype=torch.bool, device=s.device)
    if causal:
        visible = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        visible = visible & mask
    elif mask is not None:
        s = s + mask.double()
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # not exp(s - lse): a row held at finfo.min rounds lse to s
    return p @ v, p, lse


def ref_stats(q, k, v, mask, kw):
    """Column sums and row entropy from the float64 map (rows with no visible key: P = 0), for the
    statistics tests; kw holds is_causal and enable_gqa."""
    _, p, _ = reference(q, k, v, mask, kw["is_causal"], q.shape[-1] ** -0.5, kw["enable_gqa"])
    ent = -torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), 0.0).sum(-1)
    return p.sum(-2), ent


def rel_err(got, want):
    """Relative Frobenius error of got against a float64 want."""
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


def assert_stats_match_float64(st, q, k, v, mask, kw):
    """col_sum and row_entropy of attention_stats's result st: fp32, within 1e-5 of float64 on
    the same rounded inputs, as a whole (relative Frobenius) and element by element."""
    assert st["col_sum"].dtype == st["row_entropy"].dtype == torch.float32
    want_cols, want_ent = ref_stats(q, k, v, mask, kw)
    for key, want in (("col_sum", want_cols), ("row_entropy", want_ent)):
        assert rel_err(st[key], want) <= 1e-5, (key, rel_err(st[key], want))
        torch.testing.assert_close(st[key].double(), want, rtol=1e-5, atol=1e-5, msg=key)
