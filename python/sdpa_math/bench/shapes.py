"""The benchmark's shapes: a row's problem size (Shape), the named sets of rows (`--set`), the
input variants real models pass, and the inputs of a row (make_inputs)."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    Hq: int
    Hkv: int
    L: int
    S: int
    D: int
    causal: bool = False
    variant: str = ""  # "" (contiguous, no mask) or a key of VARIANTS

    def p_elems(self):
        return self.B * self.Hq * self.L * self.S

    def base_name(self):
        """The row this one varies: the same shape with contiguous inputs and no mask."""
        return self.name[: -len(self.variant) - 1] if self.variant else self.name

    def padded_keys(self):
        """Masked rows: how many keys at the end of each batch's key sequence are padding. Batch
        b pads b·S/(2B) of them (batch 0 none, the last almost half), so no row is fully masked
        and the batches differ, as in a padded batch of prompts of different lengths."""
        return [b * self.S // (2 * self.B) for b in range(self.B)]


# The seven anchor shapes of docs/design.md (GPU).
ANCHORS = [
    Shape("prefill1k_d64", 4, 16, 16, 1024, 1024, 64),
    Shape("prefill1k_d128", 4, 16, 16, 1024, 1024, 128),
    Shape("prefill2k_d128_causal", 2, 16, 16, 2048, 2048, 128, True),
    Shape("gqa1k_d128", 4, 32, 8, 1024, 1024, 128),
    Shape("decode_s2k_d128", 32, 32, 32, 1, 2048, 128),
    Shape("tail100_d64", 8, 16, 16, 100, 1100, 64),
    Shape("long4k_d128_causal", 1, 32, 32, 4096, 4096, 128, True),
]
# Sized for a 2-core CPU: each forward takes milliseconds, not seconds.
CPU_SET = [
    Shape("cpu_256_d64", 1, 8, 8, 256, 256, 64),
    Shape("cpu_512_d64", 2, 8, 8, 512, 512, 64),
    Shape("cpu_512_d128_causal", 1, 8, 8, 512, 512, 128, True),
    Shape("cpu_gqa512_d64", 1, 8, 2, 512, 512, 64),
    Shape("cpu_decode_s2k_d64", 4, 8, 8, 1, 2048, 64),
    Shape("cpu_tail100_d64", 2, 8, 8, 100, 300, 64),
]
# CI's gate: small and quick, still well past timer resolution.
CI_SET = [
    Shape("ci_256_d64", 1, 4, 4, 256, 256, 64),
    Shape("ci_384_d64_causal", 1, 4, 4, 384, 384, 64, True),
    Shape("ci_gqa256_d64", 1, 8, 2, 256, 256, 64),
]


# The inputs real models pass (Hugging Face attention modules), as variants of one shape. Each
# row gets the base shape's name with the variant's as a suffix; every implementation gets the
# same tensors.
VARIANTS = {
    "fmask": "float additive mask (B, 1, L, S) in the inputs' dtype: 0, or finfo(dtype).min on padded keys",
    "kpad": "key-padding bool mask (B, 1, 1, S), True = attend",
    "hfmask": "Hugging Face's causal-and-padding bool mask (B, 1, L, S): row i attends to keys <= i that are "
              "not padding",
    "blhe": "q, k, v as .transpose(1, 2) views of contiguous (B, L, H, E) tensors",
}
# The variants with a mask; each hides the last `padded_keys()[b]` keys of batch b.
MASKED_VARIANTS = ("fmask", "kpad", "hfmask")


def variants_of(base: Shape):
    return [dataclasses.replace(base, name=f"{base.name}_{v}", variant=v) for v in VARIANTS]


def _shape(shapes, name):
    return next(s for s in shapes if s.name == name)


def variant_base(device):
    """The shape the variant rows vary: prefill1k_d128 on the GPU, cpu_512_d64 on the CPU."""
    return _shape(ANCHORS, "prefill1k_d128") if device == "cuda" else _shape(CPU_SET, "cpu_512_d64")


def variants(device):
    """The variant rows with their base row, the time they are compared with."""
    return [variant_base(device)] + variants_of(variant_base(device))


def sweep(device):
    lengths = [256, 512, 1024, 2048, 4096] if device == "cuda" else [64, 128, 256, 512, 1024]
    heads = 16 if device == "cuda" else 4
    return [Shape(f"sweep_{n}_d64", 1 if device == "cpu" else 4, heads, heads, n, n, 64) for n in lengths]


SETS = {"anchors": lambda d: ANCHORS, "cpu": lambda d: CPU_SET, "ci": lambda d: CI_SET, "sweep": sweep,
        "anchors+sweep": lambda d: ANCHORS + sweep(d), "cpu+sweep": lambda d: CPU_SET + sweep(d),
        "variants": variants,
        "anchors+variants": lambda d: ANCHORS + variants_of(variant_base("cuda")),
        "cpu+variants": lambda d: CPU_SET + variants_of(variant_base("cpu"))}


def make_inputs(s: Shape, dtype, device, seed=0):
    """q, k, v (B, H, n, E) and the mask (None unless the variant has one) of a row. "blhe":
    q, k, v drawn as contiguous (B, n, H, E) and viewed as (B, H, n, E), the layout Hugging Face
    attention modules pass. "fmask": a materialised (B, 1, L, S) float mask in the inputs' dtype,
    0 or finfo(dtype).min (Hugging Face's padding mask for eager and SDPA). "kpad": a (B, 1, 1, S)
    bool mask, True = attend. "hfmask": a (B, 1, L, S) bool mask, the causal rule (top left: row i
    sees keys <= i) and the padding in one, as Hugging Face builds it for SDPA when a batch is
    padded. The masks hide the last `s.padded_keys()[b]` keys of batch b."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if s.variant == "blhe":
        mk = lambda h, n: torch.randn(s.B, n, h, s.D, generator=gen, device=device,  # noqa: E731
                                      dtype=dtype).transpose(1, 2)
    else:
        mk = lambda h, n: torch.randn(s.B, h, n, s.D, generator=gen, device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(s.Hq, s.L), mk(s.Hkv, s.S), mk(s.Hkv, s.S)
    mask = None
    if s.variant in MASKED_VARIANTS:
        valid = s.S - torch.tensor(s.padded_keys(), device=device)
        attend = torch.arange(s.S, device=device) < valid.unsqueeze(-1)  # (B, S)
        if s.variant == "kpad":
            mask = attend[:, None, None, :].contiguous()
        elif s.variant == "hfmask":
            causal = torch.arange(s.S, device=device) <= torch.arange(s.L, device=device)[:, None]  # (L, S)
            mask = (attend[:, None, :] & causal)[:, None].contiguous()
        else:
            mask = torch.zeros(s.B, 1, s.L, s.S, dtype=dtype, device=device)
            mask.masked_fill_(~attend[:, None, None, :], torch.finfo(dtype).min)
    return q, k, v, mask
