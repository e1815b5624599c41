"""SwiGLU, GeGLU and bias + GELU: 16384 rows x 8192, bf16."""

from __future__ import annotations

import torch

from onepass import ops, reference
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants

ROWS, HIDDEN, DTYPE = 16384, 8192, torch.bfloat16


def _make(kind: str, mode: str):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def make():
        a = torch.randn(ROWS, HIDDEN, device="cuda", dtype=DTYPE, requires_grad=grad)
        if kind == "bias_gelu":
            b = torch.randn(HIDDEN, device="cuda", dtype=DTYPE, requires_grad=grad)
            return variants(
                onepass=step(ops.bias_gelu, a, b),
                eager=step(reference.bias_gelu, a, b),
                torch_compile=step(compiled(reference.bias_gelu), a, b),
            )
        u = torch.randn(ROWS, HIDDEN, device="cuda", dtype=DTYPE, requires_grad=grad)
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


# minimum bytes, in units of one [ROWS, HIDDEN] tensor: (forward, forward + backward)
_PASSES = {"swiglu": (3, 8), "geglu": (3, 8), "bias_gelu": (2, 5)}


def cases() -> list[Case]:
    size = ROWS * HIDDEN * DTYPE.itemsize
    return [Case(kind, mode, f"{ROWS}x{HIDDEN} bf16", _make(kind, mode), bytes=passes * size)
            for kind, (f, fb) in _PASSES.items() for mode, passes in (("fwd", f), ("fwd+bwd", fb))]
