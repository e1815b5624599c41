import pytest
import torch

from onepass import selfcheck


def test_every_op_passes_its_selfcheck_and_has_a_budget(device):
    from onepass import ops

    assert {c.op for c in selfcheck.CHECKS} == set(ops.__all__)  # every public op (add_layer_norm, adamw were not)
    lines = []
    assert selfcheck.run(device, log=lines.append)
    body = "\n".join(lines[1:])
    for c in selfcheck.CHECKS:
        assert f"{c.op} " in body
    # the byte budget of a memory-bound op: unfused bytes (counted) above the fused minimum
    row = next(line for line in lines if line.startswith("rms_norm "))
    assert "fwd " in row and "->" in row


def test_a_wrong_kernel_fails_the_selfcheck(device, monkeypatch):
    check = next(c for c in selfcheck.CHECKS if c.op == "swiglu")
    monkeypatch.setattr(check, "run", lambda m, g, u: m.swiglu(g, u) * (1.001 if m is not selfcheck.reference else 1))
    assert selfcheck.check(check, device) > 1e-4


def test_budgets_come_from_the_benchmark_cases():
    fused = selfcheck.fused_bytes()
    assert fused[("rms_norm", "fwd")] == 2 * 16384 * 4096 * torch.bfloat16.itemsize
    with pytest.raises(KeyError):
        fused[("no_such_op", "fwd")]


def test_refused_where_no_kernel_runs(device):
    """Every op would compare its reference with itself and pass (the library call said ok)."""
    from onepass import reference_mode

    with reference_mode(), pytest.raises(ValueError, match="nothing would be checked"):
        selfcheck.run(device)


def test_without_transformers_every_op_is_checked_and_the_budget_needing_it_says_so(device, monkeypatch):
    """adamw_step's benchmark case takes Llama-3.2-1B's parameter shapes from its transformers model."""
    import sys

    from onepass import DISTRIBUTION

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    without = set()
    fused = selfcheck.fused_bytes(without)
    assert without == {"optim"} and ("rms_norm", "fwd") in fused and "adamw_step" not in {op for op, _ in fused}
    monkeypatch.setattr(selfcheck, "CHECKS", [c for c in selfcheck.CHECKS if c.op == "adamw_step"])
    lines = []
    assert selfcheck.run(device, log=lines.append)
    assert lines[1].startswith("adamw_step ") and lines[1].endswith(
        f"ok      no byte budget here: its benchmark case needs transformers: pip install '{DISTRIBUTION}[hf]'")
