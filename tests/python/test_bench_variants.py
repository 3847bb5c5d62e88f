"""The harness's input-variant rows (sdpa_math.bench: a (B, 1, L, S) float mask, a (B, 1, 1, S)
key-padding bool mask, Hugging Face's causal-and-padding (B, 1, L, S) bool mask, q/k/v as
transposed views of (B, L, H, E)): the sets that hold them, the
inputs they build, and that every implementation the harness times gives, on those inputs, the
O and P of a plain computation on contiguous, unmasked, unpadded inputs. Then one whole row on
the CPU, as `bench run` times it."""
import math

import pytest
import torch

from sdpa_math import bench
from sdpa_math.bench import Impls, Shape, make_inputs, variants_of

aten_math = torch.ops.aten._scaled_dot_product_attention_math

# Small enough for every implementation on 2 cores; B = 4 gives four padding lengths (0, 3, 6, 9
# of S = 24 keys).
TINY = Shape("tiny", 4, 2, 2, 16, 24, 8)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _variant(name):
    return next(s for s in variants_of(TINY) if s.variant == name)


def test_the_sets_hold_the_variant_rows_with_their_base():
    names = [s.name for s in bench.SETS["variants"]("cuda")]
    assert names == ["prefill1k_d128", "prefill1k_d128_fmask", "prefill1k_d128_kpad", "prefill1k_d128_hfmask",
                     "prefill1k_d128_blhe"]
    anchors_variants = [s.name for s in bench.SETS["anchors+variants"]("cuda")]
    assert anchors_variants == [s.name for s in bench.ANCHORS] + names[1:]
    assert [s.name for s in bench.SETS["variants"]("cpu")][0] == "cpu_512_d64"
    assert [s.name for s in bench.SETS["cpu+variants"]("cpu")][-4:] == [
        "cpu_512_d64_fmask", "cpu_512_d64_kpad", "cpu_512_d64_hfmask", "cpu_512_d64_blhe"]
    for s in bench.SETS["variants"]("cuda")[1:]:
        assert (s.B, s.Hq, s.Hkv, s.L, s.S, s.D, s.causal) == (4, 16, 16, 1024, 1024, 128, False)
        assert s.base_name() == "prefill1k_d128"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_variant_inputs(dtype):
    q0, k0, v0, m0 = make_inputs(TINY, dtype, "cpu")
    assert m0 is None and q0.is_contiguous()
    pads = TINY.padded_keys()
    assert pads == [0, 3, 6, 9] and max(pads) < TINY.S

    q, k, v, mask = make_inputs(_variant("fmask"), dtype, "cpu")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), (q0, k0, v0)))  # same q, k, v as the base row
    assert mask.shape == (4, 1, 16, 24) and mask.dtype == dtype
    lowest = torch.finfo(dtype).min
    assert set(mask.unique().tolist()) == {0.0, lowest}
    for b, n in enumerate(pads):
        assert (mask[b, 0, :, TINY.S - n:] == lowest).all() and (mask[b, 0, :, : TINY.S - n] == 0).all()

    q, k, v, mask = make_inputs(_variant("kpad"), dtype, "cpu")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), (q0, k0, v0)))
    assert mask.shape == (4, 1, 1, 24) and mask.dtype == torch.bool
    assert (~mask).sum(dim=-1).flatten().tolist() == pads

    q, k, v, mask = make_inputs(_variant("hfmask"), dtype, "cpu")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), (q0, k0, v0)))
    assert mask.shape == (4, 1, 16, 24) and mask.dtype == torch.bool and mask.is_contiguous()
    for b, n in enumerate(pads):
        for i in range(TINY.L):  # row i: keys 0..i, but none of the padded ones
            assert mask[b, 0, i].nonzero().flatten().tolist() == list(range(min(i + 1, TINY.S - n)))

    q, k, v, mask = make_inputs(_variant("blhe"), dtype, "cpu")
    assert mask is None
    for t, n in ((q, TINY.L), (k, TINY.S), (v, TINY.S)):
        assert t.shape == (4, 2, n, 8) and not t.is_contiguous()
        assert t.transpose(1, 2).is_contiguous()  # a view of a contiguous (B, L, H, E) tensor


def _expected(s, q, k, v):
    """O and P from the math op in float64 on contiguous inputs, each batch on its unpadded keys
    only (no mask at all); P is zero on the padded keys."""
    scale = 1.0 / math.sqrt(s.D)
    outs, probs = [], []
    for b, pad in enumerate(s.padded_keys() if s.variant in bench.MASKED_VARIANTS else [0] * s.B):
        n = s.S - pad
        causal = s.causal or s.variant == "hfmask"  # top left, as the mask has it
        o, p = aten_math(q[b:b + 1].contiguous().double(), k[b:b + 1, :, :n].contiguous().double(),
                         v[b:b + 1, :, :n].contiguous().double(), None, 0.0, causal, scale=scale)
        outs.append(o)
        probs.append(torch.nn.functional.pad(p, (0, pad)))
    return torch.cat(outs), torch.cat(probs), scale


@pytest.fixture(scope="module")
def impls():
    return Impls("cpu")


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["fmask", "kpad", "hfmask", "blhe"])
def test_every_implementation_sees_the_variant(impls, variant, dtype):
    s = _variant(variant)
    q, k, v, mask = make_inputs(s, dtype, "cpu")
    want_o, want_p, scale = _expected(s, q, k, v)
    for name in impls.names(dtype):
        with torch.no_grad():
            res = impls.call(name, q, k, v, s, scale, mask)
        out, probs = (res, None) if name == "flash" else res
        assert out.shape == want_o.shape, name
        assert _rel(out, want_o) < TOL[dtype], (name, _rel(out, want_o))
        if probs is not None:
            assert _rel(probs, want_p) < TOL[dtype], (name, _rel(probs, want_p))
            pads = s.padded_keys() if variant != "blhe" else [0] * s.B
            for b, pad in enumerate(pads):
                if pad:
                    assert (probs[b, ..., s.S - pad:] == 0).all(), name  # padded keys get no weight


def test_a_variant_row_runs_forward_and_backward():
    """One row as `bench run` measures it: every implementation timed forward and
    forward+backward, the override taking the aten call with the mask, the row naming its base."""
    s = _variant("kpad")
    ceil = {"copy_Bps": 1e10, "mm_flops": 1e11, "mm_dtype": "float32"}
    row = bench.run_row(Impls("cpu"), s, torch.float32, "cpu", ceil, reps=3)
    assert row["shape"] == "tiny_kpad" and row["variant_of"] == "tiny" and row["variant"] == "kpad"
    for name, r in row["impls"].items():
        assert "error" not in r, (name, r.get("error"))
        assert "fwd_ms" in r and "fwdbwd_ms" in r, name
    assert row["impls"]["override"]["override_took_call"]
    assert row["impls"]["ours"]["rel_err_o"] < 1e-5 and row["impls"]["ours"]["rel_err_p"] < 1e-5
    assert row["floor"]["bytes"] > bench.floor_ms(TINY, torch.float32, ceil)["bytes"]  # the mask is read
    assert {"fwd_ms", "fwdbwd_ms"} <= set(row["speedup"])
    base = dict(row, shape="tiny", variant="", variant_of=None)
    md = bench.markdown({"info": {"device": "cpu", "cpu": "x", "torch": "t", "time": "now"}, "ceilings": ceil,
                         "rows": [base, row]})
    assert "Input variants" in md and "| tiny_kpad | float32 |" in md
