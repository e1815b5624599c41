"""Every op's self-check: forward and backward on fresh random inputs against the float64
reference, and its byte budget at benchmark size, fused against the unfused minimum.

On a machine without a GPU the Triton kernels run through Triton's interpreter, so set
``TRITON_INTERPRET=1`` before onepass is imported (``onepass selfcheck`` does).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from onepass import ops, reference
from onepass.testing import TOLERANCE, rel_error


@dataclass
class Check:
    op: str
    suite: str  # the benchmark suite holding the op's byte budget
    inputs: Callable[[str], tuple]  # device -> small fp32 inputs (tensors needing grads first)
    run: Callable  # (onepass or reference module, *inputs) -> tensor or tuple of tensors


def _rand(*shape, device):
    return torch.randn(*shape, device=device)


CHECKS = [
    Check("rms_norm", "norm", lambda d: (_rand(6, 300, device=d), _rand(300, device=d)),
          lambda m, x, w: m.rms_norm(x, w)),
    Check("layer_norm", "norm", lambda d: (_rand(6, 300, device=d), _rand(300, device=d), _rand(300, device=d)),
          lambda m, x, w, b: m.layer_norm(x, w, b)),
    Check("add_rms_norm", "norm", lambda d: (_rand(6, 300, device=d), _rand(6, 300, device=d), _rand(300, device=d)),
          lambda m, x, r, w: m.add_rms_norm(x, r, w)),
    Check("swiglu", "activation", lambda d: (_rand(6, 300, device=d), _rand(6, 300, device=d)),
          lambda m, g, u: m.swiglu(g, u)),
    Check("geglu", "activation", lambda d: (_rand(6, 300, device=d), _rand(6, 300, device=d)),
          lambda m, g, u: m.geglu(g, u)),
    Check("bias_gelu", "activation", lambda d: (_rand(6, 300, device=d), _rand(300, device=d)),
          lambda m, x, b: m.bias_gelu(x, b)),
]


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check(c: Check, device: str) -> float:
    """The worst relative error over the outputs and every input gradient."""
    inputs = [t.requires_grad_(True) for t in c.inputs(device)]
    outs = _outputs(c.run(ops, *inputs))
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    doubles = [t.detach().double().requires_grad_(True) for t in inputs]
    refs = _outputs(c.run(reference, *doubles))
    torch.autograd.backward(refs, [g.double() for g in grads])
    errors = [rel_error(o, r) for o, r in zip(outs, refs)] + [rel_error(t.grad, d.grad) for t, d in zip(inputs, doubles)]
    return max(errors)


def byte_budgets() -> dict[tuple[str, str], tuple[str, int]]:
    """{(op, mode): (shape, fused minimum bytes)} from the benchmark suites, built without a GPU."""
    budgets = {}
    for suite in dict.fromkeys(c.suite for c in CHECKS):
        for case in importlib.import_module(f"onepass.bench.suites.{suite}").cases():
            budgets[(case.op, case.mode)] = (case.shape, case.bytes)
    return budgets


def run(device: str = "cpu", log=print) -> bool:
    budgets = byte_budgets()
    tol = TOLERANCE[torch.float32]
    log(f"{'op':<14} {'max rel. error (fp32)':>22}  {'verdict':<7}  fused minimum bytes at benchmark size")
    ok = True
    for c in CHECKS:
        err = check(c, device)
        passed = err <= tol
        ok &= passed
        sizes = "; ".join(f"{mode} {budgets[(c.op, mode)][1] / 1e6:,.0f} MB" for mode in ("fwd", "fwd+bwd")
                          if (c.op, mode) in budgets)
        shape = next((budgets[(c.op, m)][0] for m in ("fwd", "fwd+bwd") if (c.op, m) in budgets), "")
        log(f"{c.op:<14} {err:>22.2e}  {'ok' if passed else 'FAILED':<7}  {shape}: {sizes}")
    return ok
