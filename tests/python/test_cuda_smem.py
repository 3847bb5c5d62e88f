"""Tile choices for GPUs with less shared memory per block than the H200's 227 KB: 163 KB (A100)
and 99 KB (RTX 30/40, L4, L40S). The launchers read the device's limit; SDPA_MATH_SMEM_LIMIT
lowers the limit they see, so the H200 runs a smaller GPU's choices. Each limit runs in a fresh
process (the limit is read once), with the Hopper kernels off (SDPA_MATH_SM90=0: they exist only
for compute capability 9.0, which always has 227 KB), on problems of head sizes 64, 128 and 256,
forward and backward against the math op in float64 (test_fuzz.check_problem). The kernel names
show which key-tile width ran."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CHILD = r"""
import json, sys, torch
from cases import Case
from cuda_helpers import cuda_kernels
from test_fuzz import check_problem
kernels = set()
for E in (64, 128, 256):
    for dtype in (torch.float16, torch.bfloat16):
        for mask in ("none", "float"):
            case = Case(batch=(2,), hq=2, hkv=2, L=70, S=150, E=E, Ev=E, mask=mask)
            _, names = cuda_kernels(lambda: check_problem(case, dtype, seed=E, device="cuda"))
            kernels.update(names)
print(json.dumps(sorted(kernels)))
"""


def run_with_limit(limit):
    env = dict(os.environ, SDPA_MATH_SM90="0", SDPA_MATH_POISON_OUTPUTS="1")
    if limit:
        env["SDPA_MATH_SMEM_LIMIT"] = str(limit)
    tests = pathlib.Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tests), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def tiles(kernels, name):
    """{(head tile, key tile)} of the tensor-core kernel `name` (forward_tc / backward_tc) launched."""
    found = set()
    for k in kernels:
        m = re.search(name + r"<[^,]+, (\d+), (\d+), (?:true|false)>", k)
        if m:
            found.add((int(m.group(1)), int(m.group(2))))
    return found


def test_the_h200_takes_the_widest_key_tiles():
    kernels = run_with_limit(None)
    assert tiles(kernels, "forward_tc") == {(64, 64), (128, 64), (256, 32)}, kernels
    assert tiles(kernels, "backward_tc") == {(64, 64), (128, 64), (256, 32)}, kernels


@pytest.mark.parametrize("limit, forward, backward", [
    # 99 KB: forward 256 with 16-key tiles (32 need 99 KB + its row flags); backward 128 with 32
    # keys (64 need 104 KB), 256 with 16 (32 need 118 KB).
    (101376, {(64, 64), (128, 64), (256, 16)}, {(64, 64), (128, 32), (256, 16)}),
    # 80 KB: forward 128 (87 KB) and backward 256 (95 KB at 16 keys) have no tile that fits and go
    # to the generic path, still correct.
    (81920, {(64, 64), (256, 16)}, {(64, 64), (128, 32)}),
    # 48 KB (a GPU that does not opt in beyond the default): only the forward of head 64 fits.
    (49152, {(64, 64)}, set()),
])
def test_smaller_gpus_get_tiles_that_fit(limit, forward, backward):
    kernels = run_with_limit(limit)
    assert tiles(kernels, "forward_tc") == forward, kernels
    assert tiles(kernels, "backward_tc") == backward, kernels
