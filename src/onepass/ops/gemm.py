"""cuBLAS GEMMs into an output of another dtype than their operands (16-bit in, fp32 out)."""

from __future__ import annotations

import torch
from torch import Tensor


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor, beta: int, alpha: float = 1.0) -> Tensor:
    """acc = beta * acc + alpha * a @ b in acc's dtype (beta = 0: acc is not read, so no memset first)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta, alpha=alpha)
    elif acc.is_cuda:
        # 16-bit operands, fp32 accumulator and output
        torch.addmm(acc, a, b, beta=beta, alpha=alpha, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta, alpha=alpha)  # the CPU has no mixed-dtype GEMM
    return acc
