"""The built extension as a user's build makes it: one C++ runtime in the process.

A toolchain that links the C++ runtime statically (seen on the GPU machine: its compiler wrapper's
lib folder has libstdc++.a only) gave an extension with a private, exported copy of the runtime;
PyTorch had loaded the shared one, and the process died on the first formatted error message.
These tests fail on such a build: it may link the shared runtime, or keep a static copy local,
but must not export one, and a validation error must reach Python as an exception.
"""
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import sdpa_math

# Itanium-ABI names of the C++ runtime: exception handling, std:: and its type information.
RUNTIME = re.compile(r"^(__cxa_|__gxx_personality|_ZSt|_ZNSt|_ZNKSt|_ZTISt|_ZTSSt|_ZTVSt|_ZNSo|_ZNSi|_ZdlPv|_Znwm)")


def _extension():
    return next(pathlib.Path(sdpa_math.__file__).parent.glob("_C*.so"))


def test_extension_exports_no_cpp_runtime_symbols():
    if shutil.which("nm") is None:
        pytest.skip("no nm (binutils)")
    out = subprocess.run(["nm", "-D", "--defined-only", str(_extension())], capture_output=True, text=True,
                         check=True).stdout
    exported = [line.split()[-1] for line in out.splitlines() if line.strip()]
    runtime = [name for name in exported if RUNTIME.match(name)]
    assert not runtime, f"{len(runtime)} C++ runtime symbols exported, e.g. {runtime[:5]}"


def test_extension_links_the_shared_runtime():
    if shutil.which("readelf") is None:
        pytest.skip("no readelf (binutils)")
    out = subprocess.run(["readelf", "-d", str(_extension())], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so.6" in out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_validation_error_reaches_python_in_a_fresh_process(device):
    """In a subprocess, so that a crash fails this test instead of ending the test run."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    code = (
        "import torch, sdpa_math\n"
        f"x = torch.randn(4, device='{device}')\n"
        "try:\n"
        "    sdpa_math.attention(x, x, x)\n"
        "except RuntimeError as e:\n"
        "    print('raised:', str(e).splitlines()[0])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    # The whole message: the mixed-runtime build above also cut it short at the shape's "(".
    assert "raised:" in run.stdout and "got shape (4)" in run.stdout, run.stdout


def test_installed_version_is_the_packages_one():
    """The version is written once (__version__); the wheel's metadata and CMake read it from there."""
    import importlib.metadata

    try:
        installed = importlib.metadata.version("sdpa_math")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sdpa_math imported from a source tree, not an installed build")
    assert installed == sdpa_math.__version__
