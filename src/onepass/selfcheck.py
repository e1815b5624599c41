"""Every op's self-check: forward and backward on fresh random inputs against the float64
reference, and its byte budget at benchmark size: what the unfused PyTorch version moves
(counted by the analyzer on meta tensors) against the fused minimum (the benchmark case's).

On a machine without a GPU the Triton kernels run through Triton's interpreter, so
``TRITON_INTERPRET=1`` must be set before Triton is imported (``onepass selfcheck`` does).
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
    suite: str  # the benchmark suite whose case gives the fused minimum bytes
    inputs: Callable[[str, bool], tuple]  # (device, benchmark size?) -> inputs; float ones get gradients
    run: Callable  # (ops or reference, *inputs) -> tensor or tuple of tensors
    n_grad: int = 99  # how many leading inputs get gradients (rope's tables get none)


def _rows(n_tensors: int, cols: int, vectors: int = 0):
    """n [rows, cols] tensors then ``vectors`` [cols] ones: 6 x 300 small, 16384 x cols at benchmark size."""
    def make(device, big):
        rows, width = (16384, cols) if big else (6, 300)
        dtype = torch.bfloat16 if big else torch.float32
        return (*(torch.randn(rows, width, device=device, dtype=dtype) for _ in range(n_tensors)),
                *(torch.randn(width, device=device, dtype=dtype) for _ in range(vectors)))
    return make


def _scores(device, big):
    shape, dtype = ((64, 4096, 4096), torch.bfloat16) if big else ((2, 5, 40, 40), torch.float32)
    return (torch.randn(shape, device=device, dtype=dtype),)


def _rope_inputs(device, big):
    b, hq, hk, s, d = (4, 32, 8, 4096, 128) if big else (2, 4, 2, 9, 16)
    dtype = torch.bfloat16 if big else torch.float32
    angles = torch.randn(s, d // 2, device=device)
    emb = torch.cat((angles, angles), dim=-1)
    return (torch.randn(b, hq, s, d, device=device, dtype=dtype), torch.randn(b, hk, s, d, device=device, dtype=dtype),
            emb.cos().to(dtype), emb.sin().to(dtype))


CHECKS = [
    Check("rms_norm", "norm", _rows(1, 4096, 1), lambda m, x, w: m.rms_norm(x, w)),
    Check("layer_norm", "norm", _rows(1, 4096, 2), lambda m, x, w, b: m.layer_norm(x, w, b)),
    Check("add_rms_norm", "norm", _rows(2, 4096, 1), lambda m, x, r, w: m.add_rms_norm(x, r, w)),
    Check("swiglu", "activation", _rows(2, 8192), lambda m, g, u: m.swiglu(g, u)),
    Check("geglu", "activation", _rows(2, 8192), lambda m, g, u: m.geglu(g, u)),
    Check("bias_gelu", "activation", _rows(1, 8192, 1), lambda m, x, b: m.bias_gelu(x, b)),
    Check("softmax", "softmax", _scores, lambda m, x: m.softmax(x, scale=0.125, causal=True)),
    Check("rope", "rope", _rope_inputs, lambda m, q, k, cos, sin: m.rope(q, k, cos, sin), n_grad=2),
]


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check(c: Check, device: str) -> float:
    """The worst relative error over the outputs and every input gradient."""
    inputs = c.inputs(device, False)
    for t in inputs[:c.n_grad]:
        t.requires_grad_(True)
    outs = _outputs(c.run(ops, *inputs))
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    doubles = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    refs = _outputs(c.run(reference, *doubles))
    torch.autograd.backward(refs, [g.double() for g in grads])
    errors = [rel_error(o, r) for o, r in zip(outs, refs)]
    errors += [rel_error(t.grad, d.grad) for t, d in zip(inputs, doubles) if t.requires_grad]
    return max(errors)


def unfused_bytes(c: Check, mode: str) -> tuple[int, int]:
    """(bytes, launches) of the reference at benchmark size, counted by the analyzer on meta tensors."""
    from onepass.analyze import analyze

    inputs = c.inputs("meta", True)
    for t in inputs[:c.n_grad]:
        t.requires_grad_(mode == "train")
    totals = analyze(lambda *xs: c.run(reference, *xs), *inputs, mode=mode, meta=True, quiet=True).totals()
    return totals["bytes"], totals["launches"]


def fused_bytes() -> dict[tuple[str, str], int]:
    """{(op, mode): minimum bytes} from the benchmark suites' first case of each op (built without a GPU)."""
    budgets: dict[tuple[str, str], int] = {}
    for suite in dict.fromkeys(c.suite for c in CHECKS):
        for case in importlib.import_module(f"onepass.bench.suites.{suite}").cases():
            budgets.setdefault((case.op, case.mode), case.bytes)
    return budgets


def run(device: str = "cpu", log=print) -> bool:
    fused = fused_bytes()
    tol = TOLERANCE[torch.float32]
    log(f"{'op':<13} {'max rel. err':>12} {'':<6}  bytes at benchmark size, bf16: "
        "unfused PyTorch (launches) -> fused minimum")
    ok = True
    for c in CHECKS:
        err = check(c, device)
        passed = err <= tol
        ok &= passed
        budget = []
        for mode, analyzer_mode in (("fwd", "forward"), ("fwd+bwd", "train")):
            if (c.op, mode) in fused:
                moved, launches = unfused_bytes(c, analyzer_mode)
                budget.append(f"{mode} {moved / 1e6:,.0f} MB ({launches}) -> {fused[(c.op, mode)] / 1e6:,.0f} MB")
        log(f"{c.op:<13} {err:>12.2e} {'ok' if passed else 'FAILED':<6}  {'; '.join(budget)}")
    return ok
