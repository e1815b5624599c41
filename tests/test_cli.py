"""The onepass command: clear refusals (exit code 2, one line on stderr) instead of tracebacks or vacuous passes."""

from __future__ import annotations

import re

import pytest
import torch

from onepass.cli import main


@pytest.mark.parametrize("argv", [["bench", "ops"], ["bench", "train"], ["bench", "generate"]])
def test_benchmarks_without_a_gpu_say_so(argv, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the benchmark would run")
    assert main(argv) == 2
    assert "need a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["bench", "ops", "--suite", "nosuch"], "--suite"),
    (["bench", "train", "--model", "nosuch"], "--model"),
    (["bench", "train", "--batch", "0"], "--batch"),
    (["bench", "generate", "--new", "1"], "--new"),
])
def test_bad_benchmark_arguments_are_refused_before_anything_runs(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and words in capsys.readouterr().err


def test_selfcheck_refuses_reference_mode(monkeypatch, capsys):
    """With ONEPASS_REFERENCE=1 every op runs its reference: the self-check would compare the
    reference with itself and pass without running a kernel."""
    monkeypatch.setenv("ONEPASS_REFERENCE", "1")
    assert main(["selfcheck"]) == 2
    assert "ONEPASS_REFERENCE" in capsys.readouterr().err


def test_python_dash_m_runs_the_command():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "onepass", "bench", "ops", "--suite", "nosuch"], capture_output=True,
                         text=True, check=False, timeout=300)
    assert run.returncode == 2 and "--suite" in run.stderr


TOP_LEVEL_ANSWERS = """
import sys
from onepass.cli import main
for argv in (["--help"], ["--version"], ["bench", "--help"], [], ["nosuch"]):
    try:
        main(argv)
    except SystemExit as stop:
        print(stop.code, file=sys.stderr)
print("torch" in sys.modules)
"""


def test_help_version_and_a_bad_command_are_answered_before_torch_loads():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", TOP_LEVEL_ANSWERS], capture_output=True, text=True, check=False,
                         timeout=120)
    assert run.stdout.splitlines()[-1] == "False", run.stdout
    assert [line for line in run.stderr.splitlines() if line in ("0", "2")] == ["0", "0", "0", "2", "2"], run.stderr
    assert "{run,selfcheck,bench,analyze}" in run.stdout and "{ops,sweep,sweep-report,train,generate}" in run.stdout


def test_dir_lists_the_public_api():
    import onepass

    assert {"optimize", "undo", "optimize_report", "Decoder", "generate", "ops", "optim"} <= set(dir(onepass))


def test_version_prints_the_package_version(capsys):
    import onepass

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"onepass {onepass.__version__}\n"


@pytest.mark.parametrize("argv, defaults", [
    (["run"], []),
    (["selfcheck"], []),
    (["bench", "ops"], ["default: all)", "(default: benchmarks/results)"]),
    (["bench", "train"], ["(default: llama-1b;", "(default: 4;", "(default: 0)", "(default: 1)", "(default: 2)"]),
    (["bench", "generate"], ["(default: llama-1b)", "default: 1 and 8)", "(default: 128)", "(default: 256)"]),
    (["analyze"], ["(default: llama-1b)", "(default: H100)", "(default: forward)", "(default: 1)",
                   "(default: bfloat16)", "(default: 12)", "(default: the terminal only)"]),
])
def test_every_command_help_says_what_it_does_and_its_defaults(argv, defaults, capsys):
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0
    usage, description, *rest = text.split("\n\n")
    assert description.strip() and not description.startswith(("options:", "positional")), text
    flat = " ".join(text.split())  # argparse wraps to the terminal's width
    for default in defaults:
        assert default in flat, (default, text)
    lines = text.split("options:", 1)[1].splitlines()
    for i, line in enumerate(lines):  # every option says what it is (argparse shows no default for one without)
        if line.startswith("  -") and "--help" not in line:
            help_beside = len(re.split(r"\s{2,}", line.strip())) > 1
            help_below = i + 1 < len(lines) and lines[i + 1].startswith(" " * 6)
            assert help_beside or help_below, (line, text)


# Without transformers (the hf extra) a command runs what it can and says in one line what needs it.
# (onepass first: its import hook takes a None there for an imported transformers)
HIDE_TRANSFORMERS = """
import sys
from onepass.cli import main
sys.modules["transformers"] = None  # as if not installed
for argv in {commands}:
    print(main(argv), flush=True)
    print("--", file=sys.stderr, flush=True)
"""


def test_commands_that_build_models_say_they_need_transformers():
    import subprocess
    import sys

    from onepass import DISTRIBUTION

    commands = [["analyze", "--model", "llama-tiny"], ["bench", "generate"],
                ["bench", "train", "--gpus", "2", "--model", "llama-tiny"]]
    run = subprocess.run([sys.executable, "-c", HIDE_TRANSFORMERS.format(commands=commands)], capture_output=True,
                         text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["2"] * len(commands)
    said = [part.strip() for part in run.stderr.split("--")[:-1]]
    for argv, line in zip(commands, said):
        name = " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
        assert line == (f"onepass {name}: needs transformers (its models are Hugging Face models): "
                        f"pip install '{DISTRIBUTION}[hf]'"), run.stderr


def test_run_without_transformers_checks_the_ops_and_says_the_analyzer_needs_it(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run would benchmark")
    import sys

    from onepass import DISTRIBUTION, selfcheck

    monkeypatch.setitem(sys.modules, "transformers", None)
    checked = []
    monkeypatch.setattr(selfcheck, "run", lambda device, log=print: checked.append(device) or True)
    assert main(["run"]) == 0 and checked == ["cpu"]
    assert capsys.readouterr().err.splitlines() == [
        f"onepass run: the analyzer on llama-1b skipped: it needs transformers: pip install '{DISTRIBUTION}[hf]'"]


def test_bench_ops_without_transformers_skips_the_suites_that_need_it(monkeypatch, capsys):
    import sys

    from onepass import DISTRIBUTION
    from onepass.bench import harness

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ran = []
    monkeypatch.setattr(harness, "run_suites", lambda suites, out, only: {s: ran.append(s) or ["row"] for s in suites})
    assert main(["bench", "ops"]) == 0
    assert ran == [s for s in harness.SUITES if s != "optim"]  # optim takes Llama-3.2-1B's parameter shapes
    assert capsys.readouterr().err.splitlines() == [
        f"onepass bench ops: skipping optim: needs transformers: pip install '{DISTRIBUTION}[hf]'"]
    assert main(["bench", "ops", "--suite", "optim"]) == 2 and ran == [s for s in harness.SUITES if s != "optim"]


def test_selfcheck_says_which_numpy_triton_3_6s_interpreter_needs(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: no interpreter")
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.3.1")
    assert main(["selfcheck"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "onepass selfcheck: Triton 3.6.0's interpreter needs numpy < 2.3 (here 2.3.1): pip install 'numpy<2.3', "
        "or Triton 3.7 or later"]


def test_ctrl_c_ends_a_command_with_one_line_and_code_130(monkeypatch, capsys):
    from onepass import selfcheck

    def interrupted(device, log=print):
        raise KeyboardInterrupt

    monkeypatch.setattr(selfcheck, "run", interrupted)
    assert main(["selfcheck"]) == 130
    assert capsys.readouterr().err.splitlines() == ["onepass selfcheck: interrupted"]


def test_bench_without_what_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["bench"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "onepass bench: error: the following arguments are required: {ops,sweep,sweep-report,train,generate}")
