"""Scale, mask and softmax in one pass (the attention-probabilities step of eager attention).

Math, per row of N scores (the last dim; any other ``dim`` is moved last first):

    z   = x * scale + mask        (bool mask: z = -inf where mask is False)
    z   = -inf where j > i + (S_k - S_q)       (causal; x is [..., S_q, S_k], row i, column j)
    y   = exp(z - max z) / sum(exp(z - max z))
    y   = 0 on a row whose every z is -inf     (torch.softmax gives NaN there)

Backward (the mask is a constant unless an additive mask requires grad):

    dz  = y * (dy - sum(dy * y)),   dx = dz * scale,   d(mask) = dz summed to mask's shape

Byte budget (M rows of N, element size s; the mask broadcasts, so it is read through
stride-0 dims and never expanded in memory; a causal mask is never read at all):

    op           unfused PyTorch (HF style)                  fused minimum
    fwd          ~8 passes: x*scale (r,w), +mask (r,r,w),     read x, write y          2 MNs
                 softmax (r 3x, w)                            (causal: the hidden tail of a row,
                                                               past the next multiple of 16, is
                                                               not read, only written as zeros)
    bwd          ~5 passes                                    read y, dy; write dx     3 MNs

A program takes BLOCK_M rows (several short rows in one 2-D tile, or one long row).
Rows up to MAX_ROW_BLOCK live in registers: one read, one write. Longer rows make two
passes, an online max/sum then the normalised write (the re-read hits L2).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.dispatch import (
    cdiv,
    check_float,
    check_same_device,
    empty_output,
    first_order_only,
    is_int,
    is_number,
    launch,
    row_settings,
    triton_op,
    use_triton,
)

LOG2E = tl.constexpr(1.4426950408889634)  # the kernels work in base 2: exp(z) = exp2(z * log2(e))

# A tile holds at least TILE_ELEMENTS scores (several short rows per program), VALUES_PER_THREAD of them a
# thread: one row of 1024 to 4096 a program with 32 values a thread was the fastest of the tiles and warps
# benchmarks/tune_cells.py softmax tried (results/h100-80gb-hbm3/tune_cells.log).
TILE_ELEMENTS = 1024
VALUES_PER_THREAD = 32

NO_MASK, BOOL_MASK, ADD_MASK = 0, 1, 2

# ----------------------------------------------------------------------------- kernels


@triton.jit
def _rows_and_visible(n_rows, n_cols, seq_q, diag, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's rows (int64), their query index, how many leading columns each sees
    ([BLOCK_M, 1]), and how many it loads: the visible count rounded up to 16, so the
    loads stay 16-byte vectors (compiled for sm_90: scalar loads otherwise)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    q = rows % seq_q
    if CAUSAL:
        visible = tl.minimum(tl.maximum(q + diag + 1, 0), n_cols)
        loaded = tl.minimum((visible + 15) // 16 * 16, n_cols)
    else:
        visible = tl.zeros_like(rows) + n_cols
        loaded = visible
    in_rows = rows < n_rows
    return rows, q, tl.where(in_rows, visible, 0)[:, None], tl.where(in_rows, loaded, 0)[:, None]


@triton.jit
def _scores(x_row, m_row, c, vis, loaded, scale_log2, m_col_stride, MASK: tl.constexpr):
    """z * log2(e) for a [BLOCK_M, BLOCK_N] tile, -inf where masked; hidden columns are not read."""
    ld = c < loaded
    z = tl.load(x_row + c, mask=ld, other=0.0).to(tl.float32) * scale_log2
    keep = c < vis
    if MASK == 1:
        keep = keep & (tl.load(m_row + c * m_col_stride, mask=ld, other=0) != 0)
    if MASK == 2:
        z += tl.load(m_row + c * m_col_stride, mask=ld, other=0.0).to(tl.float32) * LOG2E
    return tl.where(keep, z, -float("inf"))


@triton.jit
def _softmax_fwd_kernel(
    x_ptr, mask_ptr, y_ptr,
    n_rows, n_cols, seq_q, heads, diag, scale_log2,
    x_batch_stride, x_head_stride, x_row_stride,
    m_batch_stride, m_head_stride, m_row_stride, m_col_stride,
    MASK: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    rows, q, vis, loaded = _rows_and_visible(n_rows, n_cols, seq_q, diag, CAUSAL, BLOCK_M)
    # x and the mask are [batch, heads, S_q, S_k] through their own (possibly 0) strides
    t = rows // seq_q
    b, h = t // heads, t % heads
    x_row = x_ptr + (b * x_batch_stride + h * x_head_stride + q * x_row_stride)[:, None]
    m_row = mask_ptr + (b * m_batch_stride + h * m_head_stride + q * m_row_stride)[:, None]
    y_row = y_ptr + (rows * n_cols)[:, None]
    in_rows = (rows < n_rows)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if ONE_BLOCK:
        z = _scores(x_row, m_row, cols, vis, loaded, scale_log2, m_col_stride, MASK)
        mx = tl.max(z, axis=1)
        mx = tl.where(mx == -float("inf"), 0.0, mx)  # a fully masked row: every exp2(-inf) = 0, no NaN
        e = tl.exp2(z - mx[:, None])
        total = tl.sum(e, axis=1)
        inv = 1.0 / tl.where(total == 0, 1.0, total)  # total = 0: every e is 0, y = 0 (a NaN total stays NaN)
        tl.store(y_row + cols, (e * inv[:, None]).to(y_ptr.dtype.element_ty), mask=in_rows & (cols < n_cols))
    else:
        # Pass 1: online max and sum over the visible prefix only (masked blocks skipped).
        mx = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, tl.max(tl.max(loaded, axis=1), axis=0).to(tl.int32), BLOCK_N):
            c = start + cols
            z = _scores(x_row, m_row, c, vis, loaded, scale_log2, m_col_stride, MASK)
            new_mx = tl.maximum(mx, tl.max(z, axis=1))
            safe = tl.where(new_mx == -float("inf"), 0.0, new_mx)
            total = total * tl.exp2(mx - safe) + tl.sum(tl.exp2(z - safe[:, None]), axis=1)
            mx = new_mx
        mx = tl.where(mx == -float("inf"), 0.0, mx)
        inv = 1.0 / tl.where(total == 0, 1.0, total)  # total = 0: every e is 0, y = 0 (a NaN total stays NaN)
        # Pass 2: write every column; the hidden tail is not read and comes out 0.
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            z = _scores(x_row, m_row, c, vis, loaded, scale_log2, m_col_stride, MASK)
            y = tl.exp2(z - mx[:, None]) * inv[:, None]
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=in_rows & (c < n_cols))


@triton.jit
def _softmax_bwd_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, seq_q, diag, scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    # y, dy and dx are contiguous [n_rows, n_cols]; y is 0 wherever the forward masked
    # (the few hidden columns loaded past the visible ones included), so dx is 0 there.
    rows, _, _, loaded = _rows_and_visible(n_rows, n_cols, seq_q, diag, CAUSAL, BLOCK_M)
    off = (rows * n_cols)[:, None]
    in_rows = (rows < n_rows)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if ONE_BLOCK:
        keep = cols < loaded
        y = tl.load(y_ptr + off + cols, mask=keep, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + off + cols, mask=keep, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, axis=1)
        dx = y * (dy - dot[:, None]) * scale
        tl.store(dx_ptr + off + cols, dx.to(dx_ptr.dtype.element_ty), mask=in_rows & (cols < n_cols))
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, tl.max(tl.max(loaded, axis=1), axis=0).to(tl.int32), BLOCK_N):
            c = start + cols
            keep = c < loaded
            y = tl.load(y_ptr + off + c, mask=keep, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off + c, mask=keep, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, axis=1)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            keep = c < loaded
            y = tl.load(y_ptr + off + c, mask=keep, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + off + c, mask=keep, other=0.0).to(tl.float32)
            dx = y * (dy - dot[:, None]) * scale
            tl.store(dx_ptr + off + c, dx.to(dx_ptr.dtype.element_ty), mask=in_rows & (c < n_cols))


# ---------------------------------------------------------------------------- launchers


def _settings(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): short rows share a tile of TILE_ELEMENTS scores."""
    block_n, _ = row_settings(n_cols)
    block_m = max(1, TILE_ELEMENTS // block_n)
    num_warps = max(1, min(16, block_m * block_n // (32 * VALUES_PER_THREAD)))
    return block_m, block_n, num_warps


def _merge_batch_dims(shape: list[int], *strides: list[int]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every tensor steps through evenly (stride 0 included)."""
    keep = [i for i, n in enumerate(shape) if n != 1]
    shape, strides = [shape[i] for i in keep], [[s[i] for i in keep] for s in strides]
    i = len(shape) - 2
    while i >= 0:
        if all(s[i] == s[i + 1] * shape[i + 1] for s in strides):
            shape[i:i + 2] = [shape[i] * shape[i + 1]]
            for s in strides:
                s[i:i + 2] = [s[i + 1]]
        i -= 1
    return shape, strides


def _as_4d(x: Tensor, mask: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor], list[int], list[int], list[int]]:
    """x and the mask (broadcast to x, still stride 0 where it broadcasts) as [batch, heads, S_q, S_k]
    strides; returns (x, mask, [batch, heads], x strides, mask strides). Copies only x with a
    strided last dim, or both when more than two batch dims cannot merge (rare)."""
    if x.dim() < 2:
        x = x.reshape(1, -1)
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        x = x.contiguous()
    m = mask.expand(x.shape) if mask is not None else x
    shape, (xs, ms) = _merge_batch_dims(list(x.shape[:-2]), list(x.stride()[:-2]), list(m.stride()[:-2]))
    if len(shape) > 2:
        x, m = x.contiguous(), m.contiguous()
        shape, (xs, ms) = _merge_batch_dims(list(x.shape[:-2]), list(x.stride()[:-2]), list(m.stride()[:-2]))
    pad = 2 - len(shape)
    shape, xs, ms = [1] * pad + shape, [0] * pad + xs, [0] * pad + ms
    return x, (m if mask is not None else None), shape, xs + list(x.stride()[-2:]), ms + list(m.stride()[-2:])


def _softmax_fwd_launch(x: Tensor, mask: Optional[Tensor], scale: float, causal: bool) -> Tensor:
    y = empty_output(x)
    if x.numel() == 0:
        return y
    x4, m4, (_, heads), xs, ms = _as_4d(x, mask)
    n_cols = x4.shape[-1]
    seq_q = x4.shape[-2]
    n_rows = x4.numel() // n_cols
    mode = NO_MASK if mask is None else BOOL_MASK if mask.dtype == torch.bool else ADD_MASK
    if mode == BOOL_MASK:
        m4 = m4.view(torch.uint8)
    block_m, block_n, num_warps = _settings(n_cols)
    launch(_softmax_fwd_kernel, (cdiv(n_rows, block_m),),
        x4, m4 if m4 is not None else x4, y,
        n_rows, n_cols, seq_q, heads, n_cols - seq_q, scale * LOG2E.value,
        xs[0], xs[1], xs[2], ms[0], ms[1], ms[2], ms[3],
        MASK=mode, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, ONE_BLOCK=n_cols <= block_n,
        num_warps=num_warps,
    )
    return y


def _softmax_bwd_launch(dy: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    dx = empty_output(y)
    if y.numel() == 0:
        return dx
    dy = dy.contiguous()
    n_cols = y.shape[-1]
    seq_q = y.shape[-2] if y.dim() >= 2 else 1
    n_rows = y.numel() // n_cols
    block_m, block_n, num_warps = _settings(n_cols)
    launch(_softmax_bwd_kernel, (cdiv(n_rows, block_m),),
        y, dy, dx, n_rows, n_cols, seq_q, n_cols - seq_q, scale,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, ONE_BLOCK=n_cols <= block_n, num_warps=num_warps,
    )
    return dx


# ------------------------------------------------------------------ registered ops


@triton_op("onepass::softmax_fwd", mutates_args=())
def _softmax_fwd(x: Tensor, mask: Optional[Tensor], scale: float, causal: bool) -> Tensor:
    """softmax(x * scale + mask) over the last dim; y is contiguous."""
    return _softmax_fwd_launch(x, mask, scale, causal)


@triton_op("onepass::softmax_bwd", mutates_args=())
def _softmax_bwd(dy: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    """dx = y * (dy - sum(dy * y)) * scale over the last dim."""
    return _softmax_bwd_launch(dy, y, scale, causal)


def _setup_context(ctx, inputs, output):
    x, mask, scale, causal = inputs
    ctx.save_for_backward(output)
    ctx.scale, ctx.causal = scale, causal
    ctx.mask_shape = mask.shape if mask is not None and mask.requires_grad else None


def _backward(ctx, dy):
    first_order_only("softmax")
    (y,) = ctx.saved_tensors
    if ctx.mask_shape is None:
        return _softmax_bwd(dy, y, ctx.scale, ctx.causal), None, None, None
    # A trainable additive mask (a learned bias): its gradient is dz, summed over its broadcast dims.
    dz = _softmax_bwd(dy, y, 1.0, ctx.causal)
    return dz * ctx.scale, dz.sum_to_size(ctx.mask_shape), None, None


_softmax_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public function


def _check(x, dim, scale, mask, causal):
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    if not is_int(dim):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not is_number(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim}")
    if causal and (x.dim() < 2 or dim % x.dim() != x.dim() - 1):
        raise ValueError("causal=True needs x of shape [..., S_q, S_k] and dim=-1 (the keys)")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            check_float("mask", mask)
        if not _broadcasts_to(mask.shape, x.shape):
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape {tuple(x.shape)}")
    check_same_device(x=x, mask=mask)


def _broadcasts_to(shape, target) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def softmax(x: Tensor, dim: int = -1, scale: float = 1.0, mask: Tensor | None = None, causal: bool = False
            ) -> Tensor:
    """``softmax(x * scale + mask, dim)`` in one pass, with an optional causal mask computed in the kernel.

    Like ``torch.softmax(x * scale + mask, dim)`` as eager attention writes it, computed in
    fp32, returned in x's dtype. ``mask`` is bool (True = keep, like SDPA's ``attn_mask``)
    or an additive float mask; it broadcasts to x and is read through its broadcast
    strides, never expanded. An additive mask that requires grad gets its gradient.
    ``causal=True`` (x of shape [..., S_q, S_k], ``dim=-1``): query i sees keys
    j <= i + (S_k - S_q), the bottom-right alignment of SDPA's ``is_causal`` with a KV
    cache; the hidden columns are never read. It combines with ``mask``.

    A row whose every entry is masked gives zeros (and zero gradient), not NaN as
    ``torch.softmax`` gives. A ``dim`` other than the last is moved last: x is copied once
    into that layout and the result comes back as a view of x's shape.
    """
    _check(x, dim, scale, mask, causal)
    if not use_triton(x):
        return reference.softmax(x, dim, scale, mask, causal)
    last = x.dim() - 1
    dim = dim % x.dim()
    if dim == last:
        return _softmax_fwd(x, mask, float(scale), bool(causal))
    if mask is not None:
        mask = mask.expand(x.shape).movedim(dim, -1)
    return _softmax_fwd(x.movedim(dim, -1), mask, float(scale), False).movedim(-1, dim)
