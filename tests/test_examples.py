"""The examples run, and say what they should."""

import pathlib
import runpy

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's log(0) in the interpreter printed one
def test_example_runs(script, device, capsys):
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capsys.readouterr().out
    assert device in out


def test_optimize_example_keeps_the_loss(device, capsys):
    runpy.run_path(str(EXAMPLES / "optimize_llama.py"), run_name="__main__")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    before, after = (float(w.rstrip(",")) for w in last.split() if w[0].isdigit())
    assert abs(before - after) <= 1e-3 * abs(before)


def test_lora_example_fuses_every_adapter_and_learns(device, capsys):
    runpy.run_path(str(EXAMPLES / "lora_finetune.py"), run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("lora: fused: " in line for line in lines)
    losses = [float(w.rstrip(",")) for w in lines[-1].split(":")[-1].split()]
    assert len(losses) == 5 and losses[-1] < losses[0]
