"""The onepass command: clear refusals (exit code 2, one line on stderr) instead of tracebacks or vacuous passes."""

from __future__ import annotations

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


def test_dir_lists_the_public_api():
    import onepass

    assert {"optimize", "undo", "optimize_report", "Decoder", "generate", "ops", "optim"} <= set(dir(onepass))


def test_version_prints_the_package_version(capsys):
    import onepass

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"onepass {onepass.__version__}\n"
