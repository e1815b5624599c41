"""Column sums of per-program fp32 partials: the last step of a weight or bias gradient.

Kernels that reduce over rows (the norm weight and bias gradients, the bias gradient of
bias_gelu) write one fp32 partial row per program; this sums those rows straight into
the parameter's dtype, one or two buffers in one launch (``part.sum(0).to(dtype)`` takes
two kernels a buffer and ~2x the host time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass.ops.dispatch import cdiv, launch

# The [partials, columns] tile a program sums at a time, and its warps; the partials are still in L2 from the
# kernel that wrote them. BLOCK_C 16: each program reads 64-byte runs of a row.
BLOCK_C = 16


def sum_settings(n_cols: int) -> tuple[int, int]:
    """(BLOCK_P, num_warps). Up to 2048 columns (at most 128 programs a buffer, and often over a thousand
    partial rows: norms' backward at narrow rows runs 8 programs an SM) 256 rows a step on 8 warps, more
    loads in flight a program; wider, 64 on 4, the fastest there of the 16-column tiles
    (results/h200/sum_partials.log)."""
    return (256, 8) if n_cols <= 2048 else (64, 4)


@triton.jit
def _sum_columns(part_ptr, out_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    parts = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        p = start + parts
        mask = (p[:, None] < n_parts) & (cols[None, :] < n_cols)
        acc += tl.load(part_ptr + p[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, part2_ptr, out2_ptr, n_parts, n_cols,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Programs (i, 0) sum columns of the first buffer, (i, 1) those of the second."""
    if tl.program_id(1) == 0:
        _sum_columns(part_ptr, out_ptr, n_parts, n_cols, BLOCK_P, BLOCK_C)
    else:
        _sum_columns(part2_ptr, out2_ptr, n_parts, n_cols, BLOCK_P, BLOCK_C)


def sum_partials(*buffers: tuple[Tensor, torch.dtype]) -> list[Tensor]:
    """``part.sum(0)`` in ``dtype`` for each (part, dtype) given: up to two contiguous fp32
    [P, N] buffers of one shape, summed in one launch (zeros when P == 0)."""
    if not buffers:
        return []
    if len(buffers) > 2 or buffers[0][0].shape != buffers[-1][0].shape:
        raise ValueError("sum_partials takes at most two partial buffers, of one shape")
    n_parts, n_cols = buffers[0][0].shape
    outs = [torch.empty(n_cols, dtype=dtype, device=part.device) for part, dtype in buffers]
    if n_cols:
        part, part2 = buffers[0][0], buffers[-1][0]
        out2 = outs[1] if len(outs) == 2 else part  # (a placeholder is an input: see dispatch.triton_op)
        block_p, num_warps = sum_settings(n_cols)
        launch(_sum_partials_kernel, (cdiv(n_cols, BLOCK_C), len(buffers)), part, outs[0], part2, out2,
               n_parts, n_cols, BLOCK_P=block_p, BLOCK_C=BLOCK_C, num_warps=num_warps)
    return outs
