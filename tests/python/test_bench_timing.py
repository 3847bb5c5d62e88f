"""The harness's CUDA timing: `gpu` samples leave out the host's time to issue a call, `wall`
samples include it, and both report that host time. A call that spends 5 ms on the host before a
tiny kernel shows the difference."""
import time

import pytest
import torch

from sdpa_math import bench
from sdpa_math.bench import timing as bench_timing

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _slow_host_call(x):
    def fn():
        time.sleep(0.005)  # host work before the launch: Python, dispatcher, autograd in a real call
        return x.add_(1)
    return fn


@cuda
@pytest.mark.parametrize("timing", ["gpu", "wall"])
def test_gpu_timing_leaves_out_the_host_and_wall_timing_keeps_it(monkeypatch, timing):
    monkeypatch.setattr(bench_timing, "TIMING", timing)
    x = torch.zeros(1024, device="cuda")
    host = {}
    timed, errors = bench.interleaved_ms({"slow": _slow_host_call(x)}, "cuda", reps=5, host=host)
    assert not errors
    ms, _ = timed["slow"]
    assert host["slow"] >= 5.0
    if timing == "gpu":
        assert ms < 1.0, f"the GPU sample holds the host's 5 ms: {ms:.3f} ms"
    else:
        assert ms >= 5.0, f"the wall sample misses the host's 5 ms: {ms:.3f} ms"


def test_cpu_samples_are_host_time():
    host = {}
    timed, _ = bench.interleaved_ms({"sleep": lambda: time.sleep(0.002)}, "cpu", reps=3, host=host)
    assert timed["sleep"][0] >= 2.0 and host["sleep"] >= 2.0
