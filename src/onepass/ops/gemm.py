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


def aligned_head(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """An LM head whose vocabulary is not a multiple of 8 (GPT-2's 50257), with zero rows (and
    bias entries) appended up to one (a copy of the head; the head itself where none is needed).
    GEMMs with such a dimension send cuBLAS to its unaligned kernels, and a logits buffer of that
    width cannot be a dense ``out=`` (PyTorch then writes a temporary and copies it):
    linear_cross_entropy at 8192 x 2048 x 50257 took 34-40 ms on an H100 against torch.compile's
    8.9, whose Inductor pads the same way (benchmarks/results/h100-80gb-hbm3/sweep.md)."""
    pad = -weight.shape[0] % 8
    if pad == 0:
        return weight, bias
    return (torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]),
            None if bias is None else torch.cat([bias, bias.new_zeros(pad)]))


def backprop_head_chunk(dz: Tensor, hidden: Tensor, weight: Tensor, d_hidden: Tensor | None, d_weight: Tensor | None,
                        d_bias: Tensor | None, first: bool) -> None:
    """A token chunk's logits gradient dz [C, V] through the LM head: d_hidden (the chunk's rows) = dz W
    (complete: the GEMM sums over V), d_weight += dz^T x (overwritten by the first chunk: no memset),
    d_bias += the sum of dz over the chunk; the ones given as None are not computed."""
    if d_hidden is not None:
        torch.mm(dz, weight, out=d_hidden)
    if d_weight is not None:
        accumulate_mm(d_weight, dz.t(), hidden, beta=int(not first))
    if d_bias is not None:
        d_bias += dz.sum(0, dtype=torch.float32)
