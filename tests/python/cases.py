"""The case space of the Python tests (mirrors tests/cpp/test_cases.cpp at smaller sizes)."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Case:
    batch: tuple = (2,)
    hq: int = 2
    hkv: int = 2
    L: int = 7
    S: int = 9
    E: int = 8
    Ev: int = 8
    mask: str = "none"  # none | float | float_pad | float_2d | bool | bool_pad | bool_rows | neginf_rows | fmin_rows
    causal: bool = False
    gqa: bool = False
    dropout: str = "none"  # none | explicit_bool | explicit_float
    layout: str = "contig"  # contig | transposed | sliced | blhe | wide_rows
    scale: float | None = None

    @property
    def id(self):
        parts = [f"b{'x'.join(map(str, self.batch)) or 0}", f"h{self.hq}kv{self.hkv}", f"L{self.L}S{self.S}E{self.E}"]
        if self.Ev != self.E:
            parts.append(f"Ev{self.Ev}")
        for flag in ("mask", "dropout", "layout"):
            val = getattr(self, flag)
            if val not in ("none", "contig"):
                parts.append(val)
        if self.causal:
            parts.append("causal")
        if self.gqa:
            parts.append("gqa")
        if self.scale is not None:
            parts.append("scale")
        return "_".join(parts)


def _make(shape, dtype, layout, gen, device):
    # Drawn on the CPU (one stream for every device), moved, then viewed: the layout survives the move.
    if layout == "transposed":
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen, dtype=torch.float64)
        return t.to(device=device, dtype=dtype).transpose(-1, -2)
    if layout == "sliced":
        t = torch.randn(*shape[:-1], 2 * shape[-1] + 1, generator=gen, dtype=torch.float64)
        return t.to(device=device, dtype=dtype)[..., 1::2]
    if layout == "blhe":  # the (..., N, H, E) storage Hugging Face modules view as (..., H, N, E)
        t = torch.randn(*shape[:-3], shape[-2], shape[-3], shape[-1], generator=gen, dtype=torch.float64)
        return t.to(device=device, dtype=dtype).transpose(-3, -2)
    if layout == "wide_rows":  # unit column stride, rows 16 elements longer than the last dim
        t = torch.randn(*shape[:-1], shape[-1] + 16, generator=gen, dtype=torch.float64)
        return t.to(device=device, dtype=dtype)[..., :shape[-1]]
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def build(case: Case, dtype, seed=0, device="cpu"):
    """Returns (args tuple, kwargs) for the aten signature, with tensors on `device`."""
    gen = torch.Generator().manual_seed(seed)
    heads = (case.hq,) if case.hq else ()
    kvheads = (case.hkv,) if case.hq else ()
    q = _make((*case.batch, *heads, case.L, case.E), dtype, case.layout, gen, device)
    k = _make((*case.batch, *kvheads, case.S, case.E), dtype, case.layout, gen, device)
    v = _make((*case.batch, *kvheads, case.S, case.Ev), dtype, case.layout, gen, device)
    full = (*case.batch, *heads, case.L, case.S)
    pad = (*case.batch, *((1,) if case.hq else ()), 1, case.S)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    uni = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    mask = None
    if case.mask == "float":
        mask = rnd(*full).to(dtype)
    elif case.mask == "float_pad":
        mask = rnd(*pad).to(dtype)
    elif case.mask == "float_2d":
        mask = (2 * rnd(case.L, case.S)).to(dtype)
    elif case.mask == "bool":
        mask = uni(*full) < 0.7
    elif case.mask == "bool_pad":
        mask = torch.arange(case.S).expand(pad) < max(1, case.S - 3)
    elif case.mask == "bool_rows":
        mask = uni(case.L, case.S) < 0.7
        mask[1::3] = False
    elif case.mask == "neginf_rows":
        mask = rnd(case.L, case.S)
        mask[uni(case.L, case.S) < 0.2] = float("-inf")
        mask[1::3] = float("-inf")
        mask = mask.to(dtype)
    elif case.mask == "fmin_rows":
        mask = rnd(case.L, case.S).float()
        mask[1::3] = torch.finfo(torch.float32).min
    dropout_p, dropout_mask = 0.0, None
    if case.dropout != "none":
        dropout_p = 0.3
        dropout_mask = uni(*full) < 0.7
        if case.dropout == "explicit_float":
            dropout_mask = dropout_mask.to(dtype)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    args = (q, k, v, move(mask), dropout_p, case.causal, move(dropout_mask))
    kwargs = dict(scale=case.scale, enable_gqa=case.gqa)
    return args, kwargs


def cases():
    out = []
    for L, S, E in [(1, 1, 8), (1, 7, 16), (7, 1, 48), (7, 7, 64), (7, 64, 80), (64, 7, 96), (64, 64, 128),
                    (33, 100, 256), (100, 33, 1), (17, 257, 64), (1, 1024, 64), (1024, 7, 32), (257, 1024, 64)]:
        out.append(Case(hq=1 if L * S > 100_000 else 2, hkv=1 if L * S > 100_000 else 2, L=L, S=S, E=E, Ev=E))
    for m in ("float", "float_pad", "float_2d", "bool", "bool_pad", "bool_rows", "neginf_rows", "fmin_rows"):
        out.append(Case(hq=3, hkv=3, L=20, S=45, E=32, Ev=32, mask=m))
    for L, S in [(7, 30), (30, 30), (30, 7)]:
        out.append(Case(L=L, S=S, causal=True, E=16, Ev=16))
    for d in ("explicit_bool", "explicit_float"):
        out.append(Case(L=13, S=21, dropout=d))
        out.append(Case(L=13, S=21, dropout=d, mask="bool_rows"))
    for ratio in (1, 2, 4, 8):
        out.append(Case(hq=8, hkv=8 // ratio, gqa=True, L=11, S=19, E=16, Ev=16))
    out.append(Case(hq=4, hkv=1, L=9, S=31))
    out.append(Case(batch=(), L=11, S=23))
    out.append(Case(batch=(), hq=0, hkv=0, L=11, S=23))
    out.append(Case(batch=(2, 3), L=11, S=23, mask="float_pad"))
    for layout in ("transposed", "sliced"):
        out.append(Case(hq=3, hkv=3, L=17, S=29, E=24, Ev=24, layout=layout, mask="float"))
    for E, Ev in [(64, 32), (32, 128)]:
        out.append(Case(L=21, S=66, E=E, Ev=Ev))
    out.append(Case(L=12, S=12, E=16, Ev=16, scale=-0.3))
    # A few query rows: on CUDA the decode path, keys split over blocks of 256. Rows over several
    # key blocks, masks (fully masked rows too), causal, explicit dropout, GQA, head dims up to 256
    # with Ev != E, strided inputs.
    out.append(Case(L=1, S=600, E=128, Ev=128))
    out.append(Case(hq=3, hkv=3, L=3, S=300, E=32, Ev=32, mask="float"))
    out.append(Case(hq=3, hkv=3, L=4, S=45, E=32, Ev=32, mask="bool_rows"))
    out.append(Case(hq=3, hkv=3, L=2, S=290, E=32, Ev=32, mask="fmin_rows"))
    out.append(Case(L=3, S=290, causal=True, E=16, Ev=16))
    out.append(Case(L=2, S=21, dropout="explicit_float", mask="bool_rows"))
    out.append(Case(hq=8, hkv=2, gqa=True, L=1, S=513, E=64, Ev=64))
    # GQA decode: a CTA takes several heads of a group (as many as divide it with heads x rows
    # <= 4): the whole group (above), half of it (8 heads a key head, a float mask per head),
    # three heads, two heads of two rows with a mask and explicit dropout, and one head of three
    # causal rows.
    out.append(Case(hq=8, hkv=1, gqa=True, L=1, S=300, E=64, Ev=64, mask="float"))
    out.append(Case(hq=6, hkv=2, gqa=True, L=1, S=290, E=32, Ev=32))
    out.append(Case(hq=4, hkv=2, gqa=True, L=2, S=270, E=16, Ev=16, mask="bool_rows", dropout="explicit_float"))
    out.append(Case(hq=4, hkv=1, gqa=True, L=3, S=40, E=16, Ev=16, causal=True))
    out.append(Case(L=4, S=66, E=256, Ev=200))
    out.append(Case(hq=3, hkv=3, L=2, S=29, E=24, Ev=24, layout="transposed", mask="float"))
    return out


# Forward tolerance per dtype (rtol, atol) against native or float64. float64: both compute in
# float64 (different summation orders). float32: fp32 dot products and exp, ~1e-6. fp16/bf16: one
# rounding of the output (unit roundoff 2^-11 / 2^-8) on each side of the comparison, plus fp32
# arithmetic; O's atol is scaled by max|V| where it is used.
FORWARD_TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (2e-5, 2e-6), torch.float16: (2e-3, 2e-5),
               torch.bfloat16: (1.6e-2, 2e-4)}


def native(args, kwargs, dtype):
    """PyTorch's own aten math op on the same inputs: fp16/bf16 upcast to fp32 (native computes
    in fp32 and rounds once), a bool mask converted as the public API converts it (True -> 0,
    False -> -inf; contract §5: a direct call would add 0/1)."""
    q, k, v, mask, p, causal, dmask = args
    up = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    cast = lambda t: None if t is None else (t.to(up) if t.is_floating_point() else t)  # noqa: E731
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=up, device=mask.device).masked_fill(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(cast(q), cast(k), cast(v), cast(mask), p, causal,
                                                             cast(dmask), **kwargs)
