"""torch.ops.sdpa_math.softmax_rows (attention.h): rows of P from their fp32 logits, against the
PyTorch ops it replaces in `rows` alone (python/sdpa_math/stats/rows_alone.py, _rows_alone): the top-left
causal mask of a window of query rows, torch.softmax, and the cast. On the CPU it runs the core's
float64 reference, on CUDA its kernel; both for three output dtypes, strided logits, long rows,
windows with a step, the rows torch.softmax makes NaN, and the errors of bad arguments."""
import pytest
import torch

import sdpa_math  # noqa: F401  (loads the ops)
from cuda_helpers import dtype_id

ops = torch.ops.sdpa_math
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# Row lengths per device. CUDA: past the kernel's 256 threads a row; 1100 and 3000 take the
# register form (2 and 4 float4s a thread, the last partly past the row), 1021 (not a multiple
# of 4) and 5000 (more than 4096 keys) the two-read form.
ROW_LENGTHS = [("cpu", 300)] + [("cuda", S) for S in (1100, 3000, 1021, 5000) if torch.cuda.is_available()]
OUT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def want(x, dtype, causal, first, step):
    """The composition _rows_alone ran before: -inf right of each row's diagonal, softmax, cast."""
    if causal:
        w, S = x.shape[-2:]
        i = first + step * torch.arange(w, device=x.device)
        x = x.masked_fill(torch.arange(S, device=x.device) > i[:, None], float("-inf"))
    return torch.softmax(x, dim=-1).to(dtype)


def close(got, expect):
    # fp32: the reference's float64 and the kernel's online sums against torch's fp32 softmax; the
    # half dtypes: both round the same fp32 values, so at most one unit in the last place apart.
    tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[expect.dtype]
    torch.testing.assert_close(got, expect, rtol=tol, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("device,S", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal,first,step", [(False, 0, 1), (True, 0, 1), (True, 60, 1), (True, 5, 3)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided_keys"])
def test_softmax_rows_match_the_ops_they_replace(device, S, dtype, causal, first, step, layout):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 3, 4, S, generator=gen) * 4).to(device)
    if layout == "transposed":  # rows and heads swapped, not copied
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "strided_keys":  # every other key of a wider tensor (the two-read form on CUDA)
        x = torch.stack((x, x + 1), -1).flatten(-2)[..., ::2]
    got = ops.softmax_rows(x, dtype, causal, first, step)
    assert got.dtype == dtype and got.shape == x.shape and got.device == x.device
    close(got, want(x, dtype, causal, first, step))
    if causal:  # hidden keys are exact zeros
        i = first + step * torch.arange(4, device=x.device)
        hidden = torch.arange(S, device=x.device) > i[:, None]
        assert (got[..., hidden] == 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_softmax_rows_long_window_on_cuda(dtype):
    """A 64-row window of long4k_d128_causal's shape (32 heads, 4096 keys), as _rows_alone passes it."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 32, 64, 4096, generator=gen) * 3).cuda()
    got = ops.softmax_rows(x, dtype, True, 4096 - 64, 1)
    close(got, want(x, dtype, True, 4096 - 64, 1))
    # each row sums to 1 up to the dtype's rounding of its elements
    assert torch.allclose(got.double().sum(-1), torch.ones(1, 32, 64, dtype=torch.float64, device="cuda"), atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("S", [40, 41])  # on CUDA: the register form, the two-read form
def test_softmax_rows_nonfinite_rows_as_torch(device, S):
    """A NaN or +inf among a row's visible logits, or no finite visible logit: a NaN row, as
    torch.softmax gives; -inf keys weigh 0; a NaN or +inf at a causally hidden key changes nothing
    (the mask replaces it). Query row k of the window sees keys 0..k under the causal mask."""
    x = torch.randn(6, S).to(device)
    x[0, 7] = float("nan")
    x[1, 3] = float("inf")
    x[2, :3] = float("-inf")
    x[3, ::2] = float("-inf")
    x[4, 30] = float("nan")
    nan_rows = {False: [True, True, False, False, True, False], True: [False, False, True, False, False, False]}
    for causal in (False, True):
        got = ops.softmax_rows(x, torch.float32, causal, 0, 1)
        close(got, want(x, torch.float32, causal, 0, 1))
        assert torch.isnan(got).all(-1).tolist() == nan_rows[causal]
        assert not torch.isnan(got[~torch.tensor(nan_rows[causal])]).any()
        assert (got[3, ::2] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_rows_refuses_bad_arguments(device):
    x = torch.randn(2, 4, 8, device=device)
    with pytest.raises(RuntimeError, match="logits have dtype float16, expected float32"):
        ops.softmax_rows(x.half(), torch.float16, False, 0, 1)
    with pytest.raises(RuntimeError, match="out has dtype float64, expected float16, bfloat16 or float32"):
        ops.softmax_rows(x, torch.float64, False, 0, 1)
    with pytest.raises(RuntimeError, match="a causal window needs first >= 0 and step >= 1, got first -1 and step 1"):
        ops.softmax_rows(x, torch.float32, True, -1, 1)
    with pytest.raises(RuntimeError, match="a causal window needs first >= 0 and step >= 1, got first 0 and step 0"):
        ops.softmax_rows(x, torch.float32, True, 0, 0)
    with pytest.raises(RuntimeError, match="logits must have at least 2 dims"):
        ops.softmax_rows(x[0, 0], torch.float32, False, 0, 1)
    # empty: nothing to do, no error
    assert ops.softmax_rows(x[:, :0], torch.float16, True, 0, 1).shape == (2, 0, 8)


def test_softmax_rows_fake_kernel_under_compile():
    """torch.compile traces the op through its fake kernel: shape and dtype without running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 5, 7)
        y = ops.softmax_rows(x, torch.bfloat16, True, 0, 1)
    assert y.shape == (2, 3, 5, 7) and y.dtype == torch.bfloat16
