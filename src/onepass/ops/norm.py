"""RMSNorm and LayerNorm, alone or fused with the residual add (+ dropout) before them.

Math, per row of N features (h is the normalised input):

    h     = residual + dropout(x)            (add_* variants; h = x otherwise)
    mean  = sum(h) / N                       (LayerNorm only; RMSNorm uses mean = 0)
    rstd  = 1 / sqrt(sum((h - mean)^2) / N + eps)
    hat   = (h - mean) * rstd
    y     = hat * w + b

Backward, with g = dy * w:

    dh    = rstd * (g - hat * mean(g * hat) - mean(g))   (the last term LayerNorm only)
          + dh_out                                          (the gradient of the h output)
    dx    = dh * keep / (1 - p)                             (dropout replayed from the seed)
    dw    = sum over rows of dy * hat,   db = sum over rows of dy

Byte budget (M rows of N, element size s; the dropout mask is never stored):

    op               unfused PyTorch (HF style)       fused minimum
    rms_norm fwd     ~5 passes: read x 3x, write 2x    read x, write y          2 MNs
    add_rms_norm fwd ~7 passes                         read x, res; write h, y  4 MNs
    norm bwd         ~9 passes                         read dy, h; write dx     3 MNs
                                                       (+ read dh_out with add_*: 4 MNs)

The forward holds one row a program, or two rows of up to PAIR_BLOCK values as one tile
(results/h100-80gb-hbm3/norm_fwd_rows.log): programs looping over rows (with or without the next row's
loads in flight) and one-pass LayerNorm statistics of a row held whole were no faster
(benchmarks/tune_rope_layer_norm.py, results/h200/tune_rope_layer_norm.log; the earlier numbers are in
CHANGELOG.md). A row wider than one block takes its sums in one pass and is normalised in a second
(results/h100-80gb-hbm3/norm_fwd_wide_and_pdl.log).

The backward gives each program a contiguous run of rows and keeps its share of dw
and db in fp32 registers; the per-program partials ([programs, N] fp32) are summed
once at the end, so no atomics contend. A row up to MAX_ROW_BLOCK is one program's block (read
twice when wider than WIDE_ROW: bwd_one_wide_block); longer rows are split by columns among
programs, after a pass that takes each row's two sums (bwd_max_block).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.dispatch import (
    MAX_ROW_BLOCK,
    cached_plan,
    cdiv,
    check_dtype_option,
    check_float,
    check_probability,
    check_same_device,
    check_same_shape,
    check_vector,
    dependent_launch,
    eager_autograd,
    empty_output,
    first_order_only,
    is_number,
    launch,
    launch_next_kernel,
    num_programs_for,
    registered_outputs,
    route,
    row_settings,
    rows_of,
    triton_op,
    use_triton,
    wait_for_previous_kernel,
)
from onepass.ops.partials import sum_partials

# Past this many values a row is wide: a program's registers hold no more of it with the norm's state.
# The backward splits a wide row's columns (or holds it, up to MAX_ROW_BLOCK, as one block);
# the forward reads it in blocks (WIDE_NORM_FWD).
WIDE_ROW = 8192

# (BLOCK_N, num_warps) of the forward on wide rows, every form: blocks of 4096 by 16 warps, the second
# pass re-reading the row from L2, where one block of up to 16384 (a row of 12288 a quarter padding) holds
# too much a thread (tune_rowwise.py wide-fwd, results/h200/tune_norm_wide_fwd.log,
# results/h100-80gb-hbm3/tune_norm_wide.log). Plain LayerNorm's by WIDE_LAYER_NORM_WARPS, faster than 16
# there, where add_layer_norm's ran as fast with either (tune_rowwise.py wide-fwd-layer, same log, run 8).
WIDE_NORM_FWD = (4096, 16)
WIDE_LAYER_NORM_WARPS = 4
# A wide LayerNorm row whose squared mean offset from its first value passes SHIFT_CANCEL times its variance
# takes its statistics again about the mean: E[d^2] - E[d]^2 in float32 loses about that factor times 2^-24
# of the variance, times the growth of the sums' rounding (~1e-5 of it below the bound).
SHIFT_CANCEL = tl.constexpr(64.0)

# One-block rows of at most PAIR_BLOCK values go two a forward program without the residual (fwd_settings).
PAIR_BLOCK = 4096


@cached_plan
def fwd_settings(n_cols: int, n_rows: int, is_rms: bool, has_residual: bool, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, ROWS) of the forward. Values a thread (so warps, by the row width): 16 for
    plain RMSNorm, 32 for LayerNorm and the add_* forms (benchmarks/tune_rowwise.py norm,
    results/h200/tune_norm_bwd.log). Plain RMSNorm counts them over the row's width rounded down to a
    power of two, not over its padded block: a row of 5120 in a block of 8192 runs 8 warps, not 16
    (benchmarks/tune_cells.py rms-fwd, results/h100-80gb-hbm3/tune_cells.log), and at most 8 warps: a row of
    8192 ran about as fast or faster with 8 than with 16 on both GPUs (those logs, h200/tune_norm_wide_fwd.log).
    Wide rows: WIDE_NORM_FWD (WIDE_LAYER_NORM_WARPS for plain LayerNorm). Without the residual, rows of a
    block of at most PAIR_BLOCK go two a program (ROWS 2: a [2, BLOCK_N] tile, twice the warps) while the
    programs still number two an SM: fewer, larger programs read narrow rows faster; four or eight rows were
    slower than two, and the add_* forms gained nothing (results/h100-80gb-hbm3/norm_fwd_rows.log)."""
    if n_cols > WIDE_ROW:
        block, num_warps = WIDE_NORM_FWD
        return block, WIDE_LAYER_NORM_WARPS if not (is_rms or has_residual) else num_warps, 1
    if is_rms and not has_residual:
        block, _ = row_settings(n_cols)
        num_warps = min(8, row_settings(1 << (max(n_cols, 1).bit_length() - 1))[1])
    else:
        block, num_warps = row_settings(n_cols, values_per_thread=32)
    rows = 2 if block <= PAIR_BLOCK and not has_residual and n_rows >= 4 * sms else 1
    return block, min(16, num_warps * rows), rows


def fwd_constant_width(n_cols, block: int) -> int:
    """The row width the forward compiles in (its N_COLS), 0 to take it at run time: compiled in
    where rows end inside a block, so the masks of the padding are constants (faster there); at
    run time where blocks tile the row, where the constant was slower for LayerNorm's wide loop
    and one-block RMSNorm (results/h200/norm_fwd_constant_width.log). A symbolic width
    (torch.compile's dynamic shapes) stays a run-time argument. Cost: one compile per such width
    (a model has one or two)."""
    return n_cols if isinstance(n_cols, int) and n_cols % block else 0


def bwd_programs_per_sm(block: int, is_rms: bool) -> int:
    """Backward programs per SM: each owns a run of rows (of one column block) and keeps its fp32
    share of dw/db. The narrower the block, the more programs, to keep as many bytes in flight: blocks
    of at most 1024 values (rows of up to 1024 features) 8, but 6 for LayerNorm's 1024-value blocks
    (its kernel holds the mean and db too, more registers a thread than RMSNorm's, and more than 6
    programs an SM were slower), of 2048 4 (benchmarks/tune_rowwise.py norm, narrow-bwd
    and narrow-bwd-layer, results/h200/tune_norm_bwd.log); one block wider than WIDE_ROW
    (bwd_one_wide_block) fills an SM alone."""
    if block <= 1024:
        return 8 if is_rms or block <= 512 else 6
    return 4 if block <= 2048 else 2 if block <= WIDE_ROW else 1


def bwd_one_wide_block(n_cols: int) -> bool:
    """Rows wider than WIDE_ROW (up to MAX_ROW_BLOCK) held as one block, one program an SM, each row
    loaded where it is used (the next row's registers, loaded ahead, would spill) and read twice, the
    second time from L1/L2 (its sums first, then dh and the dw/db share, which stay in registers):
    one read from memory, where column blocks need the sums' pass over memory first
    (bwd_max_block). RMSNorm with or without the residual stream's gradient, and LayerNorm
    (benchmarks/tune_rowwise.py one-wide-block, results/h100-80gb-hbm3/tune_norm_one_wide_block.log,
    run 4)."""
    return WIDE_ROW < n_cols <= MAX_ROW_BLOCK


def bwd_max_block(n_cols: int) -> int:
    """The widest column block a backward program holds; a wider row's columns (past MAX_ROW_BLOCK:
    bwd_one_wide_block) are split among programs, each keeping its block's dw/db share in registers
    over its rows, with the rows' two sums taken first by _norm_bwd_sums_kernel (one more read of dy
    and h)."""
    return min(n_cols, WIDE_ROW)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _centered(src, c, n_cols, mean):
    """h - mean for the columns c of a row (src: its h), in fp32; 0 past the row."""
    return tl.where(c < n_cols, tl.load(src + c, mask=c < n_cols, other=0.0).to(tl.float32) - mean, 0.0)


@triton.jit
def _load_h(x_ptr, res_ptr, row, x_row_stride, res_row_stride, cols, mask, n_cols, dropout_p, seed,
            HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVICT: tl.constexpr):
    """h = residual + dropout(x) for one block of a row, in fp32; EVICT: the loads' L2 eviction policy."""
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if HAS_DROPOUT:
        keep = tl.rand(seed, row * n_cols + cols) >= dropout_p
        x = tl.where(keep, x / (1.0 - dropout_p), 0.0)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return x


@triton.jit
def _store_h(h, h_ptr, row, h_row_stride, cols, mask):
    """Write h in the stream's dtype; return it as stored, in fp32: the row is normalised as
    the backward will read it back."""
    h = h.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * h_row_stride + cols, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr,
    n_rows, x_row_stride, res_row_stride, y_row_stride, h_row_stride,
    n_cols, eps, w_offset, dropout_p, seed,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
    ROWS: tl.constexpr, N_COLS: tl.constexpr, PDL: tl.constexpr,
):
    if N_COLS:  # the width compiled in (fwd_constant_width)
        n_cols = N_COLS
    wait_for_previous_kernel(PDL)
    launch_next_kernel(PDL)
    cols = tl.arange(0, BLOCK_N)
    if ONE_BLOCK:
        # ROWS whole rows live in registers, a [ROWS, BLOCK_N] tile: one read of each input, one write of
        # each output (fwd_settings pairs rows up to PAIR_BLOCK; programs looping over rows were slower: see
        # the module docstring).
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        r, c = rows[:, None], cols[None, :]
        mask = row_ok[:, None] & (c < n_cols)
        # weight and bias loads issued first, so they overlap the row's reduction
        # (benchmarks/tune_rope_layer_norm.py ln, "wb_first" in results/h200/tune_rope_layer_norm.log)
        w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0) if HAS_WEIGHT else 1.0
        b = tl.load(b_ptr + c, mask=c < n_cols, other=0.0) if HAS_BIAS else 0.0
        h = _load_h(x_ptr, res_ptr, r, x_row_stride, res_row_stride, c, mask, n_cols, dropout_p, seed,
                    HAS_RESIDUAL, HAS_DROPOUT, "")
        if HAS_RESIDUAL:
            h = _store_h(h, h_ptr, r, h_row_stride, c, mask)
        if IS_RMS:
            centred = h
        else:
            mean = tl.sum(h, axis=1) / n_cols
            centred = tl.where(mask, h - mean[:, None], 0.0)
            tl.store(mean_ptr + rows, mean, mask=row_ok)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_ok)
        y = centred * rstd[:, None]
        if HAS_WEIGHT:
            y *= w.to(tl.float32) + w_offset
        if HAS_BIAS:
            y += b.to(tl.float32)
        tl.store(y_ptr + r * y_row_stride + c, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        row = tl.program_id(0).to(tl.int64)
        # Rows longer than one block: pass 1 takes the sums (and writes h), pass 2 normalises, re-reading
        # the row from L2 (pass 1's loads ask L2 to keep it, pass 2's to drop it). LayerNorm sums h - shift
        # and its square, the shift being the row's first value (x + residual, before dropout): mean and
        # variance in one pass without the cancellation of plain sums of h and h^2 on a row whose mean is
        # large against its spread, and without waiting before the loop for a reduction across the block
        # (tune_rowwise.py wide-fwd-layer). Where that first value lies far out (a "massive activation"),
        # the sums cancel: such a row takes its statistics again, about the mean (passes over L2).
        h = _load_h(x_ptr, res_ptr, row, x_row_stride, res_row_stride, cols, cols < n_cols, n_cols, dropout_p,
                    seed, HAS_RESIDUAL, HAS_DROPOUT, "evict_last")
        if HAS_RESIDUAL:
            h = _store_h(h, h_ptr, row, h_row_stride, cols, cols < n_cols)
        shift = 0.0
        if not IS_RMS:
            shift = tl.load(x_ptr + row * x_row_stride).to(tl.float32)
            if HAS_RESIDUAL:
                shift += tl.load(res_ptr + row * res_row_stride).to(tl.float32)
        acc_d = h - shift
        acc_sq = acc_d * acc_d
        for start in range(BLOCK_N, n_cols, BLOCK_N):
            c = start + cols
            m = c < n_cols
            h = _load_h(x_ptr, res_ptr, row, x_row_stride, res_row_stride, c, m, n_cols, dropout_p, seed,
                        HAS_RESIDUAL, HAS_DROPOUT, "evict_last")
            if HAS_RESIDUAL:
                h = _store_h(h, h_ptr, row, h_row_stride, c, m)
            d = tl.where(m, h - shift, 0.0)
            acc_d += d
            acc_sq += d * d
        src = h_ptr + row * h_row_stride if HAS_RESIDUAL else x_ptr + row * x_row_stride
        if IS_RMS:
            mean = 0.0
            var = tl.sum(acc_sq, axis=0) / n_cols
        else:
            mean_d = tl.sum(acc_d, axis=0) / n_cols
            mean = shift + mean_d
            var = tl.maximum(tl.sum(acc_sq, axis=0) / n_cols - mean_d * mean_d, 0.0)
            # (or the sums overflowed: a first value past ~1e17)
            if (mean_d * mean_d > SHIFT_CANCEL * var) | (var == float("inf")):
                # Statistics about the one-pass mean, in two passes over L2: its residue first (that mean lost
                # ~2^-24 sqrt(n) of the spread: (mean - shift)^2 <= n var where the shift is a value of the row,
                # as it is but for dropout; the residue corrects the mean either way), then the variance about
                # the corrected mean. One sum a pass: a pass summing both d and d^2 changed the sm_90 schedule
                # of pass 1, slowing every wide row (tune_norm_wide_fwd.log, run 10).
                residue = tl.zeros([BLOCK_N], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK_N):  # (each thread reads back the values it wrote)
                    residue += _centered(src, start + cols, n_cols, mean)
                mean += tl.sum(residue, axis=0) / n_cols
                acc_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK_N):
                    d = _centered(src, start + cols, n_cols, mean)
                    acc_sq += d * d
                var = tl.sum(acc_sq, axis=0) / n_cols
        rstd = 1.0 / tl.sqrt(var + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            m = c < n_cols
            h = tl.load(src + c, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            y = (h - mean) * rstd
            if HAS_WEIGHT:
                y *= tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32) + w_offset
            if HAS_BIAS:
                y += tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
            tl.store(y_ptr + row * y_row_stride + c, y.to(y_ptr.dtype.element_ty), mask=m)
        if not IS_RMS:
            tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_bwd_block(dy, h, w, m, mean, rstd, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """dy, hat and g = dy * w for one loaded block of a row (w with its offset added), in fp32 (zero
    outside the row)."""
    dy = dy.to(tl.float32)
    h = h.to(tl.float32)
    hat = (h - mean) * rstd if not IS_RMS else h * rstd
    hat = tl.where(m, hat, 0.0)
    g = dy * w.to(tl.float32) if HAS_WEIGHT else dy
    return dy, hat, g


@triton.jit
def _norm_bwd_write(dh, dh_out_ptr, dres_ptr, dx_ptr, row, dh_out_row_stride, dres_row_stride, dx_row_stride,
                    c, m, n_cols, dropout_p, seed,
                    HAS_DH_OUT: tl.constexpr, HAS_DROPOUT: tl.constexpr, WRITE_DX: tl.constexpr):
    """Add the h output's own gradient, write d(residual); write dx through the dropout mask."""
    if HAS_DH_OUT:
        dh += tl.load(dh_out_ptr + row * dh_out_row_stride + c, mask=m, other=0.0).to(tl.float32)
    tl.store(dres_ptr + row * dres_row_stride + c, dh.to(dres_ptr.dtype.element_ty), mask=m)
    if WRITE_DX:
        if HAS_DROPOUT:
            keep = tl.rand(seed, row * n_cols + c) >= dropout_p
            dh = tl.where(keep, dh / (1.0 - dropout_p), 0.0)
        tl.store(dx_ptr + row * dx_row_stride + c, dh.to(dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _norm_bwd_sums_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, sums_ptr, dy_row_stride, h_row_stride, n_rows, n_cols, rows_per_program,
    w_offset, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Each row's mean(g * hat) and mean(g), for a backward that splits its rows' columns."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    row_start = pid.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, n_rows - row_start)):
        row = row_start + i
        mean = tl.load(mean_ptr + row) if not IS_RMS else 0.0
        rstd = tl.load(rstd_ptr + row)
        s_hat_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        s_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            m = c < n_cols
            dy, hat, g = _norm_bwd_block(tl.load(dy_ptr + row * dy_row_stride + c, mask=m, other=0.0),
                                         tl.load(h_ptr + row * h_row_stride + c, mask=m, other=0.0),
                                         tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32) + w_offset
                                         if HAS_WEIGHT else 0.0,
                                         m, mean, rstd, IS_RMS, HAS_WEIGHT)
            s_hat_g += hat * g
            s_g += g
        tl.store(sums_ptr + 2 * row, tl.sum(s_hat_g, axis=0) / n_cols)
        tl.store(sums_ptr + 2 * row + 1, tl.sum(s_g, axis=0) / n_cols)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr, dh_out_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, sums_ptr, dres_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    dy_row_stride, dh_out_row_stride, h_row_stride, dres_row_stride, dx_row_stride,
    n_rows, n_cols, rows_per_program, w_offset, dropout_p, seed,
    IS_RMS: tl.constexpr, HAS_DH_OUT: tl.constexpr, HAS_DROPOUT: tl.constexpr, WRITE_DX: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, SUMS_GIVEN: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Program (p, c): the rows of run p, columns of block c. With one block a row (SUMS_GIVEN off)
    the row's two sums are taken here; wider rows take them from _norm_bwd_sums_kernel."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_start = pid.to(tl.int64) * rows_per_program
    n_mine = tl.minimum(rows_per_program, n_rows - row_start)
    part = pid.to(tl.int64) * n_cols
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + w_offset if HAS_WEIGHT else 0.0
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Rows are software-pipelined by hand: the next row's loads are issued before this
    # row's reductions, so every program keeps two rows of reads in flight.
    # A scalar condition joins a block mask through tl.where, not &: Triton's interpreter splats a
    # scalar comparison as its operands' integer type, and Triton 3.9's refuses such a mask.
    # PREFETCH off (one wide block): rows loaded where used (a wide row's next-row registers would spill).
    if PREFETCH:
        first = tl.where(n_mine > 0, mask, False)
        dy_next = tl.load(dy_ptr + row_start * dy_row_stride + cols, mask=first, other=0.0)
        h_next = tl.load(h_ptr + row_start * h_row_stride + cols, mask=first, other=0.0)
    for i in range(0, n_mine):
        row = row_start + i
        if PREFETCH:
            dy_raw, h_raw = dy_next, h_next
            more = tl.where(i + 1 < n_mine, mask, False)
            dy_next = tl.load(dy_ptr + (row + 1) * dy_row_stride + cols, mask=more, other=0.0)
            h_next = tl.load(h_ptr + (row + 1) * h_row_stride + cols, mask=more, other=0.0)
        else:
            dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0)
            h_raw = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0)
        mean = tl.load(mean_ptr + row) if not IS_RMS else 0.0
        rstd = tl.load(rstd_ptr + row)
        dy, hat, g = _norm_bwd_block(dy_raw, h_raw, w, mask, mean, rstd, IS_RMS, HAS_WEIGHT)
        if SUMS_GIVEN:
            c1 = tl.load(sums_ptr + 2 * row)
            c2 = tl.load(sums_ptr + 2 * row + 1)
        else:
            c1 = tl.sum(hat * g, axis=0) / n_cols
            c2 = tl.sum(g, axis=0) / n_cols
        if not PREFETCH:
            # One wide block: the row read again (from L1/L2) for dh and the dw share, so no fp32 copy
            # of it stays live across the reductions (it spilled). The barrier keeps the compiler from
            # merging the two reads.
            tl.debug_barrier()
            dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0)
            h_raw = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0)
            dy, hat, g = _norm_bwd_block(dy_raw, h_raw, w, mask, mean, rstd, IS_RMS, HAS_WEIGHT)
        dh = g - hat * c1
        if not IS_RMS:
            dh -= c2
        _norm_bwd_write(dh * rstd, dh_out_ptr, dres_ptr, dx_ptr, row, dh_out_row_stride, dres_row_stride,
                        dx_row_stride, cols, mask, n_cols, dropout_p, seed, HAS_DH_OUT, HAS_DROPOUT, WRITE_DX)
        dw_acc += dy * hat
        db_acc += dy
    if HAS_WEIGHT:
        tl.store(dw_part_ptr + part + cols, dw_acc, mask=mask)
    if HAS_BIAS:
        tl.store(db_part_ptr + part + cols, db_acc, mask=mask)


# ---------------------------------------------------------------------------- launchers


def _norm_fwd_launch(x, residual, weight, bias, eps, offset, dropout_p, seed, is_rms, out_dtype):
    n = x.shape[-1]
    x2, m, x_stride = rows_of(x)
    # New outputs are contiguous: their rows lie n apart whatever x's dims (no [m, n] view: each costs host time)
    y = empty_output(x, out_dtype)
    h = empty_output(x, residual.dtype) if residual is not None else None
    mean = None if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y, h, mean, rstd
    res2, _, res_stride = rows_of(residual) if residual is not None else (x2, m, x_stride)
    sms = num_programs_for(x2.device)
    block, num_warps, rows = fwd_settings(n, m, is_rms, residual is not None, sms)
    # an absent tensor's placeholder is an input (see dispatch.triton_op)
    launch(_norm_fwd_kernel, (cdiv(m, rows),),
        x2, res2, weight.contiguous() if weight is not None else x2, bias.contiguous() if bias is not None else x2,
        y, h if h is not None else x2, mean if mean is not None else x2, rstd,
        m, x_stride, res_stride, n, n, n, eps, offset, dropout_p, seed,
        IS_RMS=is_rms, HAS_RESIDUAL=residual is not None, HAS_DROPOUT=dropout_p > 0,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_N=block, ONE_BLOCK=n <= block, ROWS=rows,
        N_COLS=fwd_constant_width(n, block),
        # As a dependent launch only while its rows fit one wave of programs (a decode step's): with many
        # programs each one's wait costs more than the launch gap saved (results/h100-80gb-hbm3/
        # norm_fwd_wide_and_pdl.log).
        PDL=dependent_launch(x2) and m <= sms, num_warps=num_warps,  # (in this order: no guard on m while traced)
    )
    return y, h, mean, rstd


def _writes_dx(has_residual, dropout_p, x_dtype, h_dtype, leaves):
    """dx differs from d(residual) only through dropout or a dtype change. When x and the
    residual are both leaves that require grad, dx is written too: autograd would otherwise clone the one
    shared gradient for the second leaf's ``.grad`` (a separate copy kernel, ~2x the bytes
    of the extra write). Inside a model they are not leaves and share one tensor."""
    return has_residual and (dropout_p > 0 or x_dtype != h_dtype or leaves)


@cached_plan
def _bwd_plan(n_rows: int, n_cols: int, is_rms: bool, sms: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_N, num_warps, column blocks, programs, programs of the sums kernel, one wide block) of the
    backward: a pure function of the shape, cached (computing it costs more host time than the lookup)."""
    one_wide = bwd_one_wide_block(n_cols)
    block, num_warps = row_settings(n_cols if one_wide else bwd_max_block(n_cols))
    col_blocks = max(1, cdiv(n_cols, block))  # past one block a row, each program owns one column block of its rows
    per_sm = bwd_programs_per_sm(block, is_rms)
    programs = max(1, min(n_rows, cdiv(sms * per_sm, col_blocks)))
    return block, num_warps, col_blocks, programs, max(1, min(n_rows, sms * per_sm)), one_wide


def _norm_bwd_launch(dy, dh_out, h, weight, offset, bias_dtype, mean, rstd, dropout_p, seed, is_rms, x_dtype,
                     has_residual, leaves):
    n = h.shape[-1]
    h2, m, h_stride = rows_of(h)
    dy2, _, dy_stride = rows_of(dy)
    dh_out2, _, dh_out_stride = rows_of(dh_out) if dh_out is not None else (dy2, m, dy_stride)
    # d(residual) in the stream's dtype; dx is written separately only when it differs
    # from it (dropout, or x in another dtype than the residual stream). Both contiguous: rows n apart.
    dres = empty_output(h)
    write_dx = _writes_dx(has_residual, dropout_p, x_dtype, h.dtype, leaves)
    dx = empty_output(h, x_dtype) if write_dx else None
    block, num_warps, col_blocks, programs, sum_programs, one_wide = _bwd_plan(m, n, is_rms, num_programs_for(h.device))
    alloc = torch.empty if m > 0 else torch.zeros  # every program writes its columns; empty input: zeros
    dw_part = alloc((programs, n), dtype=torch.float32, device=h.device) if weight is not None else None
    db_part = alloc((programs, n), dtype=torch.float32, device=h.device) if bias_dtype is not None else None
    if m > 0 and n > 0:
        weight = weight.contiguous() if weight is not None else None
        w_arg, mean_arg = weight if weight is not None else h2, mean if mean is not None else rstd
        sums = None
        if col_blocks > 1:
            sums = torch.empty(m, 2, dtype=torch.float32, device=h.device)
            launch(_norm_bwd_sums_kernel, (sum_programs,), dy2, h2, w_arg, mean_arg, rstd, sums, dy_stride,
                   h_stride, m, n, cdiv(m, sum_programs), offset, IS_RMS=is_rms, HAS_WEIGHT=weight is not None,
                   BLOCK_N=block, num_warps=num_warps)
        launch(_norm_bwd_kernel, (programs, col_blocks),
            dy2, dh_out2, h2, w_arg, mean_arg, rstd, sums if sums is not None else rstd, dres,
            dx if write_dx else dy2,  # (placeholder: an input)
            dw_part if dw_part is not None else rstd, db_part if db_part is not None else rstd,
            dy_stride, dh_out_stride, h_stride, n, n,
            m, n, cdiv(m, programs), offset, dropout_p, seed,
            IS_RMS=is_rms, HAS_DH_OUT=dh_out is not None, HAS_DROPOUT=dropout_p > 0, WRITE_DX=write_dx,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias_dtype is not None, BLOCK_N=block,
            SUMS_GIVEN=col_blocks > 1, PREFETCH=not one_wide, num_warps=num_warps,
        )
    buffers = [(dw_part, weight.dtype)] if weight is not None else []
    buffers += [(db_part, bias_dtype)] if bias_dtype is not None else []
    sums = iter(sum_partials(*buffers))  # dw and db in one launch
    dw = next(sums) if weight is not None else None
    db = next(sums) if bias_dtype is not None else None
    return dres, dx, dw, db


# ------------------------------------------------------------------ registered ops


@triton_op("onepass::norm_fwd", mutates_args=())
def _norm_fwd(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
    eps: float, offset: float, dropout_p: float, seed: int, is_rms: bool, out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (y, h, mean, rstd); h is empty without a residual, mean is empty for RMSNorm."""
    return registered_outputs(_norm_fwd_launch(x, residual, weight, bias, eps, offset, dropout_p, seed, is_rms,
                                               out_dtype), x)


@triton_op("onepass::norm_bwd", mutates_args=())
def _norm_bwd(
    dy: Tensor, dh_out: Optional[Tensor], h: Tensor, weight: Optional[Tensor], offset: float,
    bias_dtype: Optional[torch.dtype], mean: Tensor, rstd: Tensor, dropout_p: float, seed: int, is_rms: bool,
    x_dtype: torch.dtype, has_residual: bool, leaves: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_h, dx, dw, db): d_h is the residual's gradient (x's without a residual);
    dx is empty unless dropout or a dtype change makes it differ from d_h; dw and db are
    empty where there is no weight or bias."""
    return registered_outputs(_norm_bwd_launch(dy, dh_out, h, weight, offset, bias_dtype, mean, rstd, dropout_p,
                                               seed, is_rms, x_dtype, has_residual, leaves), h)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, offset, dropout_p, seed, is_rms, out_dtype = inputs
    y, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    # Outputs with no incoming gradient (mean, rstd, an unused h) stay None rather than
    # being filled with zeros, which costs host time for each.
    ctx.set_materialize_grads(False)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.has_residual = residual is not None
    ctx.leaves = residual is not None and all(t.is_leaf and t.requires_grad for t in (x, residual))
    ctx.offset, ctx.dropout_p, ctx.seed, ctx.is_rms, ctx.x_dtype = offset, dropout_p, seed, is_rms, x.dtype


def _backward(ctx, dy, dh_out, *_statistics):
    first_order_only("norm")
    h, weight, mean, rstd = ctx.saved_tensors
    if dy is None:  # only h was used downstream
        dy = torch.zeros_like(h)
    d_h, dx, dw, db = route(_norm_bwd, _norm_bwd_launch, h)(
        dy, dh_out if ctx.has_residual else None, h, weight, ctx.offset, ctx.bias_dtype, mean, rstd,
        ctx.dropout_p, ctx.seed, ctx.is_rms, ctx.x_dtype, ctx.has_residual, ctx.leaves)
    dw = dw if weight is not None else None
    db = db if ctx.bias_dtype is not None else None
    if not ctx.has_residual:
        return d_h, None, dw, db, None, None, None, None, None, None
    writes_dx = _writes_dx(True, ctx.dropout_p, ctx.x_dtype, h.dtype, ctx.leaves)
    return dx if writes_dx else d_h, d_h, dw, db, None, None, None, None, None, None


_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
_norm_fwd_eager = eager_autograd(_norm_fwd_launch, _setup_context, _backward, returns=2)  # y, h


# ---------------------------------------------------------------- public functions


def _check(x, residual, weight, bias, dropout_p, eps, out_dtype=None, offset=0.0):
    check_float("x", x)
    if not (is_number(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if not is_number(offset):
        raise ValueError(f"offset must be a finite number, got {offset!r}")
    if offset and weight is None:
        raise ValueError(f"offset ({offset}) is added to the weight: it needs one, got weight=None")
    check_dtype_option("out_dtype", out_dtype)
    if residual is not None:
        check_float("residual", residual)
        check_same_shape("residual", residual, "x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the features to normalise)")
    check_vector("weight", weight, x.shape[-1])
    check_vector("bias", bias, x.shape[-1])
    check_probability("dropout_p", dropout_p)
    if dropout_p > 0 and residual is None:
        raise ValueError("dropout_p drops from x before the residual add: it needs a residual tensor")
    check_same_device(x=x, residual=residual, weight=weight, bias=bias)


def _seed(seed: int | None) -> int:
    # Drawn from torch's CPU generator: reproducible under torch.manual_seed, no device sync.
    return int(torch.randint(0, 2**31 - 1, (1,)).item()) if seed is None else int(seed)


def _norm(x, residual, weight, bias, eps, dropout_p, seed, is_rms, out_dtype, offset=0.0):
    _check(x, residual, weight, bias, dropout_p, eps, out_dtype, offset)
    out_dtype = out_dtype or x.dtype
    if not use_triton(x):
        if residual is None:
            if is_rms:
                return reference.rms_norm(x, weight, eps, out_dtype, offset), None
            return reference.layer_norm(x, weight, bias, eps, out_dtype), None
        if is_rms:
            return reference.add_rms_norm(x, residual, weight, eps, dropout_p, out_dtype=out_dtype, offset=offset)
        return reference.add_layer_norm(x, residual, weight, bias, eps, dropout_p, out_dtype=out_dtype)
    seed = _seed(seed) if dropout_p else 0
    y, h = route(_norm_fwd, _norm_fwd_launch, x, residual, weight, bias, autograd=_norm_fwd_eager)(
        x, residual, weight, bias, float(eps), float(offset), float(dropout_p), seed, is_rms, out_dtype)[:2]
    return y, (h if residual is not None else None)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
             offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (offset + weight)``, computed in fp32.

    Like ``F.rms_norm(x, (x.shape[-1],), weight, eps)``; ``out_dtype`` fuses the cast of
    the result (default: x's dtype). The default ``eps`` differs: 1e-6 here (Llama's and most
    models' value), where ``F.rms_norm``'s ``eps=None`` means the input dtype's machine epsilon
    (bf16: 0.0078): pass ``eps`` to match a call of PyTorch's without one. ``offset=1`` is
    Gemma's norm, whose weight stores scale - 1 (added in fp32 inside the kernel).
    """
    return _norm(x, None, weight, None, eps, 0.0, None, True, out_dtype, offset)[0]


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5, *,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """LayerNorm over the last dim, like ``F.layer_norm(x, (x.shape[-1],), weight, bias, eps)``."""
    return _norm(x, None, weight, bias, eps, 0.0, None, False, out_dtype)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6,
                 dropout_p: float = 0.0, *, seed: int | None = None, out_dtype: torch.dtype | None = None,
                 offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """The pre-norm residual step in one pass: ``h = residual + dropout(x)``; returns ``(rms_norm(h), h)``.

    ``h`` keeps the residual's dtype (an fp32 stream may carry bf16 branches), the normed
    output takes ``out_dtype`` (default x's). Dropout draws its mask from ``seed`` with a
    counter-based RNG; the backward replays it, so no mask is stored, and one seed always
    gives one mask. ``seed=None`` draws one from torch's CPU generator. On CPU tensors
    (no interpreter) the reference runs, with torch's own dropout. ``offset``: as in rms_norm.
    """
    return _norm(x, residual, weight, None, eps, dropout_p, seed, True, out_dtype, offset)


def add_layer_norm(x: Tensor, residual: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                   eps: float = 1e-5, dropout_p: float = 0.0, *, seed: int | None = None,
                   out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``h = residual + dropout(x)``; returns ``(layer_norm(h), h)`` in one pass (see add_rms_norm)."""
    return _norm(x, residual, weight, bias, eps, dropout_p, seed, False, out_dtype)


class _NormPassingInput(torch.autograd.Function):
    """(norm(x), x): the second output is x itself, as this node's output, so the gradient
    reaching x through it arrives here and the backward kernel adds it (dh_out) instead of
    autograd summing the two gradients of x in a separate kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, offset):
        y, _, mean, rstd = route(_norm_fwd, _norm_fwd_launch, x)(x, None, weight, bias, eps, offset, 0.0, 0, is_rms,
                                                                 x.dtype)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.bias_dtype, ctx.is_rms, ctx.offset = (bias.dtype if bias is not None else None), is_rms, offset
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_out):
        x, weight, mean, rstd = ctx.saved_tensors
        if dy is None:  # only the passed-on x was used downstream
            return dx_out, None, None, None, None, None
        first_order_only("norm")
        dx, _, dw, db = route(_norm_bwd, _norm_bwd_launch, dy)(dy, dx_out, x, weight, ctx.offset, ctx.bias_dtype, mean,
                                                                rstd, 0.0, 0, ctx.is_rms, x.dtype, False, False)
        return dx, dw if weight is not None else None, db if ctx.bias_dtype is not None else None, None, None, None


def norm_passing_input(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, is_rms: bool,
                       offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x, weight, eps), x)`` (``layer_norm`` with ``is_rms=False``) for a tensor
    that feeds a norm and also goes on (a pre-norm decoder layer's input, which is the
    residual of the layer's next add): use the returned x downstream, and the gradient it
    brings back is added inside the norm's backward kernel (a read of it) rather than by
    autograd's separate add (reads of two tensors and a write; under torch.compile too, whose
    graph otherwise keeps that add apart from the norm backward's kernel, one add a layer).
    Where no gradient flows this is ``(norm(x), x)``. ``offset``: RMSNorm's, as in rms_norm."""
    if is_rms and bias is not None:
        raise ValueError("RMSNorm takes no bias")
    if not is_rms and offset:
        raise ValueError("offset is RMSNorm's (Gemma's weight stores scale - 1); LayerNorm takes none")
    if not use_triton(x) or type(x) is not Tensor or not torch.is_grad_enabled() or not x.requires_grad:
        return _norm(x, None, weight, bias, eps, 0.0, None, is_rms, None, offset)[0], x
    _check(x, None, weight, bias, 0.0, eps, offset=offset)
    return _NormPassingInput.apply(x, weight, bias, float(eps), is_rms, float(offset))
