"""The demo (`python -m sdpa_math demo`) on the CPU with a short step budget: the tiny model must
learn the induction task (accuracy well above chance and above its start), the entropy term must
sharpen the maps it is on, sdpa_math must equal the math op on the trained model's inputs, and
the before/after picture must be written."""
import pytest
import torch

from sdpa_math import demo

STEPS = 600  # fewer than the demo's 1000: the test's budget is about 30 s on two cores


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "maps.png"
    lines = []
    res, errors, path = demo.run("cpu", out, steps=STEPS, seed=0, log=lines.append)
    print("\n" + "\n".join(lines))
    return res, errors, path, out, lines


def test_learns_the_task(ran):
    res = ran[0]
    chance = 1 / demo.VOCAB
    assert res.before.accuracy < 3 * chance
    assert res.after.accuracy > 0.5 > 10 * chance
    assert res.after.accuracy > res.before.accuracy + 0.4


def test_an_induction_head_forms(ran):
    res = ran[0]
    last = len(res.after.induction) - 1
    best = max(res.after.induction[last])
    assert best > 0.5 and best > 3 * max(res.before.induction[last])


def test_entropy_falls(ran):
    res = ran[0]
    assert res.after.entropy < res.before.entropy - 0.5
    logged = [e for _, _, _, e in res.history]
    assert logged[-1] < logged[0]


def test_equals_the_math_op(ran):
    err_o, err_p = ran[1]
    assert err_o < 1e-4 and err_p < 1e-5


def test_png_written(ran):
    path, out, lines = ran[2], ran[3], ran[4]
    pytest.importorskip("matplotlib")
    assert path == out.resolve() and out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(str(out.resolve()) in line for line in lines)


def test_main_parses_its_arguments(tmp_path, capsys):
    assert demo.main(["--device", "cpu", "--steps", "0", "--out", str(tmp_path / "m.png")]) == 0
    text = capsys.readouterr().out
    assert "task accuracy" in text and "max |P - P_math|" in text


def test_batches_repeat_their_first_half():
    ids = demo.induction_batch(8, torch.Generator().manual_seed(0), "cpu")
    assert ids.shape == (8, 2 * demo.HALF)
    assert torch.equal(ids[:, : demo.HALF], ids[:, demo.HALF:])
    assert all(len(set(row[: demo.HALF].tolist())) == demo.HALF for row in ids)
