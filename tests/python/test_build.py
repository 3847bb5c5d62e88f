"""The built extension as a user's build makes it: one C++ runtime in the process.

A toolchain that links the C++ runtime statically (seen on the GPU machine: its compiler wrapper's
lib folder has libstdc++.a only) gave an extension with a private, exported copy of the runtime;
PyTorch had loaded the shared one, and the process died on the first formatted error message.
These tests fail on such a build: it may link the shared runtime, or keep a static copy local,
but must not export one, and a validation error must reach Python as an exception.
"""
import os
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


def test_import_refuses_another_pytorch_release():
    """The extension is compiled against one PyTorch's C++ ABI; another release at run time is one
    clear error naming both, before the library is loaded (where it would be an undefined symbol
    or worse)."""
    from sdpa_math._ops import build_info

    built = build_info().get("TORCH_VERSION")
    if not built:
        pytest.skip("no build information: sdpa_math imported from a source tree")
    code = "import torch\ntorch.__version__ = '1.0.0'\nimport sdpa_math\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert f"sdpa_math was built for PyTorch {built}, but PyTorch 1.0.0 is installed" in run.stderr, run.stderr[-2000:]
    assert "pip install --no-build-isolation ." in run.stderr


def test_info_shows_what_the_build_contains():
    from sdpa_math._ops import build_info

    run = subprocess.run([sys.executable, "-m", "sdpa_math", "info"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"CPU kernels: {sdpa_math.cpu_isa()} (this build and CPU have: {', '.join(sdpa_math.cpu_isas_available())})" \
        in run.stdout, run.stdout
    built = build_info()
    if built:
        assert f"built for torch {built['TORCH_VERSION']}" in run.stdout, run.stdout
        if built["CUDA_TOOLKIT"]:
            assert f"architectures {built['CUDA_ARCHITECTURES']}" in run.stdout, run.stdout


REPO = pathlib.Path(__file__).resolve().parents[2]


def _configure(build_dir, *defines):
    """Configures the extension's build with a PATH that has no nvcc (a machine without the CUDA
    toolkit), the test's own Python and its PyTorch."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_PATH", "CUDAToolkit_ROOT")}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.run(["cmake", "-S", str(REPO), "-B", str(build_dir), "-DSDPA_MATH_BUILD_TORCH=ON",
                           "-DSDPA_MATH_BUILD_TESTS=OFF", "-DSDPA_MATH_BUILD_TOOLS=OFF",
                           f"-DPython3_EXECUTABLE={sys.executable}", *defines],
                          capture_output=True, text=True, env=env, timeout=600)


def test_cuda_pytorch_without_nvcc_is_a_build_error_with_the_fix(tmp_path):
    if torch.version.cuda is None:
        pytest.skip("a CPU-only PyTorch: a CPU-only build is what it needs")
    if shutil.which("cmake", path="/usr/bin:/bin") is None or shutil.which("nvcc", path="/usr/bin:/bin"):
        pytest.skip("needs cmake, and no nvcc, in /usr/bin:/bin")
    if not (REPO / "CMakeLists.txt").exists():
        pytest.skip("not in a source checkout")
    failed = _configure(tmp_path / "default")
    assert failed.returncode != 0
    text = " ".join((failed.stdout + failed.stderr).split())
    assert f"is built with CUDA {torch.version.cuda}, but no CUDA compiler was found" in text, text[-3000:]
    assert "-C cmake.define.SDPA_MATH_CUDA=OFF" in text
    # The CPU-only opt-in the message names configures.
    cpu_only = _configure(tmp_path / "cpu", "-DSDPA_MATH_CUDA=OFF")
    assert cpu_only.returncode == 0, (cpu_only.stdout + cpu_only.stderr)[-3000:]
    assert "sdpa_math CUDA backend: OFF" in cpu_only.stdout


@pytest.mark.skipif(torch.ops.sdpa_math.built_with_cuda() or not torch.cuda.is_available(),
                    reason="needs a CPU-only build of sdpa_math on a machine with a GPU")
def test_cpu_only_build_answers_cuda_tensors_clearly():
    x = torch.randn(1, 2, 3, 8, device="cuda")
    with pytest.raises(RuntimeError, match="this build of sdpa_math has no CUDA kernels"):
        sdpa_math.attention(x, x, x)
    out, probs = sdpa_math.attention(x.cpu(), x.cpu(), x.cpu())  # the CPU still runs
    assert torch.allclose(probs.sum(-1), torch.ones(1, 2, 3))


def test_wheel_route_builds_installs_and_runs(tmp_path):
    """The wheel route: build a wheel against the installed PyTorch (pip's PEP 517 build, without
    isolation, as `python -m build --no-isolation` does), install it into an empty target, and run
    it from there in a fresh process. CPU-only (SDPA_MATH_CUDA=OFF), to keep the build short; the
    CUDA build is the one every other test here runs."""
    if not (REPO / "pyproject.toml").exists():
        pytest.skip("not in a source checkout")
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    dist, site = tmp_path / "dist", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w",
                            str(dist), "-C", f"build-dir={tmp_path / 'build'}", "-C", "cmake.define.SDPA_MATH_CUDA=OFF",
                            str(REPO)], capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, (build.stdout + build.stderr)[-3000:]
    wheels = list(dist.glob("sdpa_math-*.whl"))
    assert len(wheels) == 1, wheels
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                              str(wheels[0])], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, (install.stdout + install.stderr)[-3000:]
    code = ("import torch, sdpa_math\n"
            "from sdpa_math._ops import build_info\n"
            "q = torch.randn(1, 2, 5, 8)\n"
            "out, probs = sdpa_math.attention(q, q, q)\n"
            "print(sdpa_math.__file__)\n"
            "print(build_info()['TORCH_VERSION'], round(float(probs.sum()), 4))\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    where, built = run.stdout.splitlines()[-2:]
    assert where.startswith(str(site)), where
    assert built == f"{torch.__version__} 10.0", built


def test_console_script_runs_info():
    """The installed console script is the same command line as python -m sdpa_math."""
    script = pathlib.Path(sys.executable).with_name("sdpa-math")
    if not script.exists():
        pytest.skip("sdpa-math is not installed next to this Python (source tree or --target install)")
    run = subprocess.run([str(script), "info"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"sdpa_math {sdpa_math.__version__}" in run.stdout, run.stdout
