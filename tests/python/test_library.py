"""torch.library.opcheck on the ops, torch.compile(fullgraph=True) against eager, and bad input
reaching Python with the core's message."""
import pytest
import torch

import sdpa_math

ops = torch.ops.sdpa_math


def _qkv(dtype=torch.float32, requires_grad=False, Hkv=2):
    q = torch.randn(2, 4, 6, 8, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(2, Hkv, 7, 8, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(2, Hkv, 7, 8, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("variant", ["plain", "float_mask_grad", "gqa_causal", "explicit_dropout", "random_dropout"])
def test_opcheck_forward(variant):
    q, k, v = _qkv(requires_grad=True, Hkv=4)
    mask, p, causal, dmask, gqa = None, 0.0, False, None, False
    if variant == "float_mask_grad":
        mask = torch.randn(1, 1, 6, 7, requires_grad=True)
    if variant == "gqa_causal":
        q, k, v = _qkv(requires_grad=True, Hkv=2)
        causal, gqa = True, True
    if variant == "explicit_dropout":
        p, dmask = 0.2, torch.rand(2, 4, 6, 7) < 0.8
    if variant == "random_dropout":
        p = 0.2
    torch.library.opcheck(ops.forward.default, (q, k, v, mask, p, causal, dmask, None, gqa, torch.tensor([11, 3])))


def test_opcheck_backward():
    q, k, v = _qkv(Hkv=4)
    mask = torch.randn(1, 1, 6, 7)
    out, probs, lse = ops.forward(q, k, v, mask, 0.0, False, None, None, False, None)
    torch.library.opcheck(ops.backward.default, (torch.randn_like(out), torch.randn_like(probs), q, k, v, mask, lse,
                                                 out, probs, 0.0, False, None, None, False, None, [True, True, True, True]))
    torch.library.opcheck(ops.backward.default, (None, torch.randn_like(probs), q, k, v, None, lse,
                                                 None, None, 0.0, False, None, None, False, None, [True, False, True, False]))


def _entropy_attention(q, k, v, mask):
    out, probs = sdpa_math.attention(q, k, v, mask, enable_gqa=True)
    entropy = -(probs * torch.log(probs.clamp_min(1e-9))).sum(-1).mean()
    return out * 2, entropy


# aot_eager runs the traced graph op by op: bit-identical to eager. Inductor fuses the entropy's
# reduction, so that term may differ by float32 rounding (seen: 3.6e-7).
@pytest.mark.parametrize("backend, tol", [("aot_eager", 0.0), ("inductor", 1e-5)])
def test_compile_fullgraph_matches_eager(backend, tol):
    q, k, v = _qkv(requires_grad=True)
    mask = torch.randn(6, 7)
    compiled = torch.compile(_entropy_attention, fullgraph=True, backend=backend)
    eager_out, eager_h = _entropy_attention(q, k, v, mask)
    comp_out, comp_h = compiled(q, k, v, mask)
    torch.testing.assert_close(comp_out, eager_out, rtol=tol, atol=tol)
    torch.testing.assert_close(comp_h, eager_h, rtol=tol, atol=tol)
    g_eager = torch.autograd.grad(eager_out.sum() + eager_h, (q, k, v))
    g_comp = torch.autograd.grad(comp_out.sum() + comp_h, (q, k, v))
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("bad, message", [
    (dict(Hkv=3, enable_gqa=True), "Number of heads in key and value must divide the number of heads in query"),
    (dict(Hkv=2), "pass enable_gqa=True"),
    (dict(causal_mask=True), "Explicit attn_mask should not be set when is_causal=True"),
    (dict(dropout_p=1.5), "dropout probability has to be between 0 and 1, but got 1.5"),
    (dict(mixed=True), "Expected query, key, and value to have the same dtype"),
    (dict(mask_dtype=torch.float64), "Expected attn_mask dtype to be bool or float or to match query dtype"),
    (dict(int_inputs=True), "query has dtype int64"),
    (dict(rank1=True), "query must have at least 2 dimensions"),
    (dict(dropout_mask_shape=True), "dropout_mask of shape (3, 3) does not match"),
])
def test_bad_input_raises_core_message(bad, message):
    q, k, v = _qkv(Hkv=bad.get("Hkv", 4))
    mask, causal, p, dmask = None, False, bad.get("dropout_p", 0.0), None
    if bad.get("causal_mask"):
        mask, causal = torch.zeros(6, 7), True
    if bad.get("mixed"):
        k = k.double()
    if "mask_dtype" in bad:
        mask = torch.zeros(6, 7, dtype=bad["mask_dtype"])
    if bad.get("int_inputs"):
        q, k, v = (t.long() for t in (q, k, v))
    if bad.get("rank1"):
        q = q[0, 0, 0]
    if bad.get("dropout_mask_shape"):
        p, dmask = 0.5, torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=None) as info:
        sdpa_math.attention(q, k, v, mask, p, causal, dmask, enable_gqa=bad.get("enable_gqa", False))
    assert message in str(info.value)


def test_mask_gradient_without_float_mask_is_an_error():
    q, k, v = _qkv(Hkv=4)
    bool_mask = torch.rand(6, 7) > 0.3
    out, probs, lse = ops.forward(q, k, v, bool_mask, 0.0, False, None, None, False, None)
    with pytest.raises(RuntimeError, match="no float attn_mask to differentiate"):
        ops.backward(torch.randn_like(out), None, q, k, v, bool_mask, lse, None, None, 0.0, False, None, None, False, None,
                     [True, True, True, True])


def test_command_line_help_info_and_unknown_command(capsys):
    from sdpa_math.__main__ import main

    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(c in usage for c in ("demo", "bench", "probe", "info"))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"sdpa_math {sdpa_math.__version__}" in out and f"torch {torch.__version__}" in out
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["run", "stats"])
def test_bench_names_a_wrong_dtype_before_anything_runs(cmd, capsys, tmp_path):
    """A comma-separated or unknown --dtypes is a usage error that names the value and the
    choices (it was a traceback from getattr(torch, ...) after the set was built)."""
    from sdpa_math import bench

    for bad in ("float32,bfloat16", "half"):
        with pytest.raises(SystemExit) as info:
            bench.main([cmd, "--device", "cpu", "--dtypes", bad, "--out", str(tmp_path)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"invalid choice: '{bad}'" in err and "float16" in err and "bfloat16" in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_public_api_is_typed_and_documented():
    """Every public function has annotations on each parameter and its return, and a docstring;
    the package says so to type checkers (py.typed, PEP 561)."""
    import importlib.resources
    import inspect

    assert importlib.resources.files("sdpa_math").joinpath("py.typed").is_file()
    for name in sdpa_math.__all__:
        fn = getattr(sdpa_math, name)
        fn = getattr(fn, "__wrapped__", fn)  # override() is a contextmanager
        sig = inspect.signature(fn)
        missing = [p for p, param in sig.parameters.items() if param.annotation is inspect.Parameter.empty]
        assert not missing, f"{name}: parameters without a type: {missing}"
        assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return type"
        assert (fn.__doc__ or "").strip(), f"{name}: no docstring"
