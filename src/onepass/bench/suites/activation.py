"""SwiGLU, GeGLU and bias + GELU: 16384 rows x 8192, bf16 (any shape: ``cases(rows, hidden)``)."""

from __future__ import annotations

import torch

from onepass import ops, reference
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants

ROWS, HIDDEN, DTYPE = 16384, 8192, torch.bfloat16


def _make(kind: str, mode: str, rows: int, hidden: int):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def make():
        a = torch.randn(rows, hidden, device="cuda", dtype=DTYPE, requires_grad=grad)
        if kind == "bias_gelu":
            b = torch.randn(hidden, device="cuda", dtype=DTYPE, requires_grad=grad)
            return variants(
                onepass=step(ops.bias_gelu, a, b),
                eager=step(reference.bias_gelu, a, b),
                torch_compile=step(compiled(reference.bias_gelu), a, b),
            )
        u = torch.randn(rows, hidden, device="cuda", dtype=DTYPE, requires_grad=grad)
        ours, ref, liger_name = ((ops.swiglu, reference.swiglu, "liger_swiglu") if kind == "swiglu"
                                 else (ops.geglu, reference.geglu, "liger_geglu"))
        liger_fn = liger("liger_kernel.transformers.functional", liger_name)
        return variants(
            onepass=step(ours, a, u),
            eager=step(ref, a, u),
            torch_compile=step(compiled(ref), a, u),
            liger=step(liger_fn, a, u) if liger_fn is not None else None,
        )

    return make


# minimum bytes, in units of one [rows, hidden] tensor: (forward, forward + backward)
_PASSES = {"swiglu": (3, 8), "geglu": (3, 8), "bias_gelu": (2, 5)}


def cases(rows: int = ROWS, hidden: int = HIDDEN) -> list[Case]:
    size = rows * hidden * DTYPE.itemsize
    return [Case(kind, mode, f"{rows}x{hidden} bf16", _make(kind, mode, rows, hidden), bytes=passes * size)
            for kind, (f, fb) in _PASSES.items() for mode, passes in (("fwd", f), ("fwd+bwd", fb))]
