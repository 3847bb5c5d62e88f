"""Every observed line of contract.md holds on the installed PyTorch (the probe's table)."""
import pytest

from sdpa_math import probe

ROWS = probe.observations("cpu")


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_observation_holds(row):
    name, holds, detail = row
    assert holds, f"contract observation changed on this PyTorch: {name} ({detail})"
