"""How onepass checks an op against its reference: one tolerance table, one error measure.

Used by the test suite and by ``onepass selfcheck``. The error is the relative norm
``||out - ref|| / ||ref||`` against the reference computed in float64; NaN never passes.
"""

from __future__ import annotations

import torch

# Relative-norm error allowed for an op computed from inputs of this dtype (fp32
# accumulation inside the kernels). bf16 keeps 8 bits of mantissa: one rounding of each
# input and output lands near 4e-3.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}


def rel_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``||out - ref|| / max(||ref||, floor)``: ``floor`` is the natural scale of a result that
    cancels to nearly zero (a gradient through a norm of one feature), where a relative
    error means nothing."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    same_inf = (out == ref) & ref.isinf()  # agreement, not an inf - inf = nan
    out, ref = out[~same_inf], ref[~same_inf]
    if not torch.isfinite(out).all() and torch.isfinite(ref).all():
        return float("inf")
    denom = max(ref.norm().item(), floor)
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str = "output",
                 scale: float = 1.0, floor: float = 0.0) -> None:
    """Fail unless ``out`` is within ``scale`` times the tolerance of ``dtype`` of ``ref``."""
    if dtype not in TOLERANCE:
        raise ValueError(f"assert_close: a tolerance for {dtype}? It has them for {list(TOLERANCE)}")
    err = rel_error(out, ref, floor)
    tol = TOLERANCE[dtype] * scale
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g} ({dtype})"

