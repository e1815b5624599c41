"""RMSNorm / LayerNorm, alone and fused with the residual add: 16384 rows x 4096, bf16
(any shape: ``cases(rows, hidden)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onepass import ops, reference
from onepass.bench.case import Case, compiled, fwd, fwd_bwd, liger, variants

ROWS, HIDDEN, DTYPE = 16384, 4096, torch.bfloat16
EPS = 1e-6


def _torch_add_rms_norm(x, res, w):
    h = x + res
    return F.rms_norm(h, x.shape[-1:], w, EPS), h


def _make(kind: str, mode: str, rows: int, hidden: int):
    grad = mode == "fwd+bwd"
    step = fwd_bwd if grad else fwd

    def tensors(n):
        return [torch.randn(rows, hidden, device="cuda", dtype=DTYPE, requires_grad=grad) for _ in range(n)]

    def make():
        w, b = (torch.randn(hidden, device="cuda", dtype=DTYPE, requires_grad=grad) for _ in range(2))
        if kind == "rms_norm":
            (x,) = tensors(1)
            return variants(
                onepass=step(ops.rms_norm, x, w, EPS),
                eager=step(reference.rms_norm, x, w, EPS),
                torch_compile=step(compiled(reference.rms_norm), x, w, EPS),
                torch=step(F.rms_norm, x, (hidden,), w, EPS),
                liger=_liger(step, "liger_rms_norm", x, w, EPS),
            )
        if kind == "layer_norm":
            (x,) = tensors(1)
            return variants(
                onepass=step(ops.layer_norm, x, w, b, EPS),
                eager=step(reference.layer_norm, x, w, b, EPS),
                torch_compile=step(compiled(reference.layer_norm), x, w, b, EPS),
                torch=step(F.layer_norm, x, (hidden,), w, b, EPS),
                liger=_liger(step, "liger_layer_norm", x, w, b, EPS),
            )
        x, res = tensors(2)
        return variants(
            onepass=step(ops.add_rms_norm, x, res, w, EPS),
            eager=step(reference.add_rms_norm, x, res, w, EPS),
            torch_compile=step(compiled(reference.add_rms_norm), x, res, w, EPS),
            torch=step(_torch_add_rms_norm, x, res, w),
            # Liger's version overwrites its inputs in place, so it only runs forward-only here
            liger=_liger(step, "liger_fused_add_rms_norm", x, res, w, EPS, in_place=False),
        )

    return make


def _liger(step, name, *args, **kwargs):
    fn = liger("liger_kernel.transformers.functional", name)
    return step(fn, *args, **kwargs) if fn is not None else None


# minimum bytes, in units of one [rows, hidden] tensor: (forward, forward + backward).
# add_rms_norm's backward reads dy, dh and h and writes a gradient for each of its two leaf
# inputs (x and residual: two .grad tensors), so 5 passes; inside a model, where neither is a
# leaf, one shared gradient makes it 4 (8 in all; older results used that count: CHANGELOG.md).
_PASSES = {"rms_norm": (2, 5), "layer_norm": (2, 5), "add_rms_norm": (4, 9)}


def cases(rows: int = ROWS, hidden: int = HIDDEN) -> list[Case]:
    size = rows * hidden * DTYPE.itemsize
    return [Case(kind, mode, f"{rows}x{hidden} bf16", _make(kind, mode, rows, hidden), bytes=passes * size)
            for kind, (f, fb) in _PASSES.items() for mode, passes in (("fwd", f), ("fwd+bwd", fb))]
