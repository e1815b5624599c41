"""The examples and the README's quickstart snippets run, and say what they should."""

import pathlib
import re
import runpy

import pytest
import torch

ROOT = pathlib.Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"


def quickstart_snippets() -> list[str]:
    """The README's Python blocks under "## Quickstart", each a whole program ("# GPU only" first: needs CUDA)."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


# examples whose own test below checks what they print (run once: the LoRA one takes minutes on the CPU)
CHECKED_APART = ("optimize_llama.py", "lora_finetune.py")
# numpy's log(0) in the interpreter printed one
NO_RUNTIME_WARNINGS = pytest.mark.filterwarnings("error::RuntimeWarning")


def _run_example(script: str, device: str, capsys) -> list[str]:
    """The lines the example printed; it names the device it ran on."""
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capsys.readouterr().out
    assert device in out
    return out.strip().splitlines()


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in CHECKED_APART))
@NO_RUNTIME_WARNINGS
def test_example_runs(script, device, capsys):
    _run_example(script, device, capsys)


@NO_RUNTIME_WARNINGS
def test_optimize_example_keeps_the_loss(device, capsys):
    last = _run_example("optimize_llama.py", device, capsys)[-1]
    before, after = (float(w.rstrip(",")) for w in last.split() if w[0].isdigit())
    assert abs(before - after) <= 1e-3 * abs(before)


@NO_RUNTIME_WARNINGS
def test_lora_example_fuses_every_adapter_and_learns(device, capsys):
    lines = _run_example("lora_finetune.py", device, capsys)
    assert any("lora: fused: " in line for line in lines)
    losses = [float(w.rstrip(",")) for w in lines[-1].split(":")[-1].split()]
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_readme_has_quickstart_snippets():
    snippets = quickstart_snippets()
    assert len(snippets) >= 3 and any("onepass.optimize(model)" in s for s in snippets)


@pytest.mark.parametrize("index", range(len(quickstart_snippets())))
def test_readme_quickstart_snippet_runs_as_written(index, device, capsys):
    """Each snippet alone, in a namespace of its own: every name it uses it defines."""
    code = quickstart_snippets()[index]
    if code.startswith("# GPU only") and not torch.cuda.is_available():
        pytest.skip("a GPU-only snippet")
    exec(compile(code, f"README.md quickstart snippet {index}", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out  # each prints what it made


def test_readme_post_training_snippet_runs_as_written(device, capsys):
    """The Python block under "### Post-training losses", alone in a namespace of its own."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n### Post-training losses\n", 1)[1].split("\n### ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    exec(compile(code, "README.md post-training snippet", "exec"), {"__name__": "__main__"})
    loss, accuracy = (float(x) for x in capsys.readouterr().out.split())
    assert loss > 0 and 0 <= accuracy <= 1
