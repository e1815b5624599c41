"""moe_experts: the experts of a mixture-of-experts layer (routing given), forward and backward.

Math (x [T, H]; each token t picks K experts e = idx[t, j] with weights w[t, j]; expert e has
gate_up [E, 2I, H] (gate rows first, then up rows) and down [E, H, I]):

    g = gate_up[e, :I] x[t],  u = gate_up[e, I:] x[t]           [I]
    h[t, j] = act(g) * u                                          [I]   act: silu, gelu (tanh or exact)
    y[t, j] = down[e] h[t, j]                                     [H]   the unweighted expert output
    out[t] = sum_j w[t, j] y[t, j]

    backward (dout [T, H]):
    dh~[t, j] = down[e]^T dout[t]                                 the unweighted gradient of h
    dw[t, j]  = <dout[t], y[t, j]> = <dh~[t, j], h[t, j]>        so y is never kept
    dh = w dh~;  dg = dh * u * act'(g);  du = dh * act(g)
    dx[t]       = sum_j gate_up[e]^T [dg; du]
    d gate_up[e] = sum over e's slots of [dg; du] x^T;  d down[e] = sum over e's slots of dout (w h)^T

Layout: the T*K (token, slot) pairs are sorted by expert (a stable sort: ``perm`` maps a
sorted row to its slot t*K + j; ``offsets`` [E+1] starts each expert's rows). Each
row-tiled kernel's program finds its expert and rows from ``offsets`` alone: expert e owns
cdiv(rows_e, BLOCK_M) consecutive tiles, so a tile never mixes experts (vLLM's
moe_align_block_size padding, without materializing the padded index). The grid is sized
by the worst case, cdiv(T*K, BLOCK_M) + min(E, T*K) tiles, and the spare ones return at once:
no host sync, any imbalance, CUDA-graph capturable.

Kernels (all tl.dot with fp32 accumulation; programs of one expert run next to each other,
grouped GROUP_M row tiles at a time, so a weight tile is read from L2 by several):

    _moe_up_kernel       gathers x rows, gate and up tiles in one program, writes h = act(g) * u
                         (and, for backward, the pre-activations [g; u] in x's dtype)
    _moe_down_kernel     y = h down[e]^T, each row stored at its slot's place ([T*K, H], slot order);
                         backward: dx per slot = [dg; du] gate_up[e], the same kernel
    _moe_combine_kernel  out[t] = sum_j w[t, j] y[t*K + j] in fp32, in order j = 0..K-1
                         (deterministic, no atomics); backward: dx[t] = sum_j dx per slot
    _moe_act_bwd_kernel  gathers dout rows, dh~ = dout down[e]; epilogue: act backward from the
                         saved [g; u], writes [dg; du] and w h, and per feature tile the partial
                         <dh~, h> (fp32 [tiles, T*K], summed once: dw)
    _moe_wgrad_kernel    per expert tile of a weight gradient, a K-loop over the expert's own rows
                         (from ``offsets``), gathering x or dout rows

Byte budget: intermediates written and read back (S = T*K slots; elements, times the element
size), beyond the GEMMs' operand reads (x or dout rows once per output tile, from L2 mostly):

    transformers' grouped_mm experts forward: gathered x (S H written, read), gate_up output
    (2 S I written, read), act(gate) and the product (S I each, written, read), y, weighted y and
    unsorted y (S H each, written, read), out (T H written): 8 S H + 8 S I + T H
    fused forward: h (S I written, read), y in slot order (S H written, read by the K-slot sum),
    out (T H): 2 S H + 2 S I + T H, and [g; u] (2 S I written) when a gradient is needed
    fused backward: [g; u] read (2 S I), [dg; du] and w h written and read (3 S I each), dx per
    slot (S H written, read), dx (T H): 2 S H + 8 S I + T H

Saved for backward: the inputs, [g; u] ([S, 2I] in x's dtype), perm ([S] int64) and offsets
([E+1] int32); not y ([S, H]) nor h. Slots whose index is outside [0, E) (transformers'
expert-parallel sentinel) contribute nothing and get a zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from onepass import reference
from onepass.ops.activation import GATED_ACTIVATIONS, act_and_grad
from onepass.ops.attention import precision_for
from onepass.ops.dispatch import (
    autocast_inputs,
    cdiv,
    check_float,
    check_same_device,
    eager_autograd,
    first_order_only,
    interpreting,
    launch,
    next_power_of_2,
    registered_outputs,
    route,
    triton_op,
    unit_stride,
    use_triton_dot,
)
from onepass.ops.partials import sum_partials

# ----------------------------------------------------------------------- settings


class Tile(NamedTuple):
    """One row-tiled kernel's features a program, warps and pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeSettings:
    """Launch settings of one moe_experts call (forward and backward share BLOCK_M: it is the routing's tile)."""

    block_m: int  # slots of one expert a program takes in the row-tiled kernels
    block_k: int
    group_m: int  # row tiles that walk the feature tiles together (weight tiles reused from L2)
    up: Tile  # gated forward: block_n features of the gate and as many of up
    down: Tile  # plain grouped GEMMs (down, dx): nothing but the accumulator to hold
    act_bwd: Tile  # dh~ GEMM with the activation backward in its epilogue (taken in two column halves)
    wgrad: tuple[int, int, int, int, int]  # weight gradients: (BLOCK_M, BLOCK_N, BLOCK_K rows, warps, stages)
    combine: tuple[int, int]  # (tokens, features) a program in the K-slot sum


# Interpreter: tiles small enough that the tests' small shapes still take several tiles, K steps and
# groups, and few programs (each costs the interpreter ~20 ms).
INTERPRETER_SETTINGS = MoeSettings(16, 32, 2, Tile(32, 4, 1), Tile(64, 4, 1), Tile(32, 4, 1), (64, 64, 32, 4, 1),
                                   (16, 128))
SHARED_MEMORY = 160 * 1024  # bytes of pipelined tiles a program may hold (H100/H200: 227 KiB a block)


def _tile(block_m: int, block_n: int, weight_tiles: int, num_warps: int, itemsize: int, block_k: int = 64) -> Tile:
    """A Tile with as many stages (2 to 4) as SHARED_MEMORY holds of the operand tiles
    [block_m + weight_tiles * block_n, block_k]."""
    per_stage = (block_m + weight_tiles * block_n) * block_k * itemsize
    return Tile(block_n, num_warps, max(2, min(4, SHARED_MEMORY // per_stage)))


def moe_settings(slots: int, n_experts: int, device: torch.device, itemsize: int = 2) -> MoeSettings:
    """Settings by rule for ``slots`` = T*K pairs over ``n_experts`` (Hopper-sized tiles), ``itemsize``-byte operands.

    BLOCK_M: 128 from 512 slots an expert (padding <= ~12%), else 64, down to 16 for decode
    batches. Tiles as wide as 8 warps' registers allow (ptxas, sm_90a): FLOPs per loaded byte bound
    what L2 feeds (128 x 256: 85, 128 x 128: 64, 64 x 256: 51); the act backward's accumulator 64 fp32
    values a thread (its epilogue in halves). The weight gradients pipeline their gathered row index
    ahead: two extra stages.
    Sweep: ``benchmarks/tune_moe.py`` (``results/h100-80gb-hbm3/tune_moe.log``: these tiles within 3%
    of the best of each kernel group at the Mixtral-8x7B and Qwen3-30B-A3B layers).
    """
    if device.type == "cpu" and interpreting():
        return INTERPRETER_SETTINGS
    per_expert = slots / max(n_experts, 1)
    block_m = min(128 if per_expert >= 512 else 64, max(16, next_power_of_2(int(per_expert) + 1)))
    warps = 8 if block_m >= 64 else 4
    wgrad_n = 256 if itemsize <= 2 else 128  # fp32 (no wgmma) spilled 0.5 KB at 256
    return MoeSettings(block_m, 64, 8, up=_tile(block_m, 128, 2, warps, itemsize),
                       down=_tile(block_m, 256, 1, warps, itemsize),
                       act_bwd=_tile(block_m, min(256, 64 * 32 * warps // block_m), 1, warps, itemsize),
                       wgrad=(128, wgrad_n, 64, 8, 2 + _tile(128, wgrad_n, 1, 8, itemsize).num_stages),
                       combine=(4, 1024))


def row_tiles(slots: int, n_experts: int, block_m: int) -> int:
    """Row tiles the grid covers: every expert's rows padded to BLOCK_M fit in this many, whatever the routing."""
    return cdiv(slots, block_m) + min(n_experts, slots)


# ------------------------------------------------------------------------ kernels


@triton.jit
def _grouped_pid(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, feature tile) of program ``pid``: GROUP_M row tiles walk the feature tiles together."""
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    size = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % size, (pid % width) // size


@triton.jit
def _expert_tile(offsets_ptr, pid_m, n_experts, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of row tile ``pid_m``; first >= end for a spare tile."""
    es = tl.arange(0, E_POW2)
    lo = tl.load(offsets_ptr + es, mask=es < n_experts, other=0)
    hi = tl.load(offsets_ptr + es + 1, mask=es < n_experts, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    before = tl.cumsum(tiles, 0) <= pid_m  # experts whose tiles all come before this one
    e = tl.sum(before.to(tl.int32), 0)
    first_tile = tl.sum(tl.where(before, tiles, 0), 0)
    valid = e < n_experts
    e = tl.minimum(e, n_experts - 1)
    start = tl.load(offsets_ptr + e) + (pid_m - first_tile) * BLOCK_M
    end = tl.where(valid, tl.load(offsets_ptr + e + 1), 0)
    return e, start, end


@triton.jit
def _tile_mm(a_ptr, a_rows, row_ok, w_ptr, cols, col_ok, n_k, w_stride_k, w_stride_n, up_offset,
             GATED: tl.constexpr, PRECISION: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A[a_rows, :n_k] @ W[:n_k, cols] in fp32 (A's rows at unit stride, ``a_rows`` element
    offsets); GATED: also A @ W[:, cols + up_offset] (the up features beside the gate's)."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] + ks[None, :]
    w_ptrs = w_ptr + ks[:, None].to(tl.int64) * w_stride_k + cols[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, n_k, BLOCK_K):
        k_ok = ks < n_k - k
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, input_precision=PRECISION)
        if GATED:
            acc_up = tl.dot(a, tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0), acc_up,
                            input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    return acc, acc_up


@triton.jit
def _moe_up_kernel(
    x_ptr, w_ptr, perm_ptr, offsets_ptr, h_ptr, gu_ptr,
    n_experts, hidden, inter, x_row_stride, w_stride_e, w_stride_n, w_stride_k, tiles_m,
    ACT: tl.constexpr, SAVE: tl.constexpr, TOP_K: tl.constexpr, E_POW2: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """h[rows] = act(x[tokens] gate^T) * (x[tokens] up^T) for one row tile of one expert; SAVE: also [g; u]."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tiles_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    e, start, end = _expert_tile(offsets_ptr, pid_m, n_experts, E_POW2, BLOCK_M)
    if start >= end:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = tl.load(perm_ptr + rows, mask=row_ok, other=0).to(tl.int64) // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    g, u = _tile_mm(x_ptr, tokens * x_row_stride, row_ok, w_ptr + e.to(tl.int64) * w_stride_e, cols, col_ok,
                    hidden, w_stride_k, w_stride_n, inter * w_stride_n, True, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    a, _ = act_and_grad(g, ACT, False)
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    tl.store(h_ptr + rows64 * inter + cols[None, :], (a * u).to(h_ptr.dtype.element_ty), mask=mask)
    if SAVE:
        gu = gu_ptr + rows64 * (2 * inter) + cols[None, :]
        tl.store(gu, g.to(gu_ptr.dtype.element_ty), mask=mask)
        tl.store(gu + inter, u.to(gu_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_down_kernel(
    a_ptr, w_ptr, perm_ptr, offsets_ptr, y_ptr,
    n_experts, n_k, n_out, w_stride_e, w_stride_n, w_stride_k, tiles_m,
    E_POW2: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y[perm[rows]] = A[rows] @ W[e] for one row tile of one expert (A sorted [S, n_k]; y [S, n_out] in slot order)."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tiles_m, tl.cdiv(n_out, BLOCK_N), GROUP_M)
    e, start, end = _expert_tile(offsets_ptr, pid_m, n_experts, E_POW2, BLOCK_M)
    if start >= end:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    acc, _ = _tile_mm(a_ptr, rows.to(tl.int64) * n_k, row_ok, w_ptr + e.to(tl.int64) * w_stride_e, cols, col_ok,
                      n_k, w_stride_k, w_stride_n, 0, False, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    slots = tl.load(perm_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    tl.store(y_ptr + slots[:, None] * n_out + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _act_bwd_epilogue(dh, rows64, row_ok, slot, w, cols, inter, gu_ptr, dgu_ptr, hw_ptr,
                      ACT: tl.constexpr, WRITE_DGU: tl.constexpr, WRITE_HW: tl.constexpr):
    """From dh~ of columns ``cols`` and the saved [g; u]: writes [dg; du] and w h; returns the rows' <dh~, h>."""
    mask = row_ok[:, None] & (cols < inter)[None, :]
    gu = gu_ptr + rows64 * (2 * inter) + cols[None, :]
    g = tl.load(gu, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + inter, mask=mask, other=0.0).to(tl.float32)
    a, da = act_and_grad(g, ACT, True)
    h = a * u
    dw = tl.sum(dh * h, axis=1)
    if WRITE_HW:
        tl.store(hw_ptr + rows64 * inter + cols[None, :], (w * h).to(hw_ptr.dtype.element_ty), mask=mask)
    if WRITE_DGU:
        dh *= w
        dgu = dgu_ptr + rows64 * (2 * inter) + cols[None, :]
        tl.store(dgu, (dh * u * da).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu + inter, (dh * a).to(dgu_ptr.dtype.element_ty), mask=mask)
    return dw


@triton.jit
def _moe_act_bwd_kernel(
    dout_ptr, w_ptr, perm_ptr, offsets_ptr, weights_ptr, gu_ptr, dgu_ptr, hw_ptr, dw_part_ptr,
    n_experts, hidden, inter, slots, dout_row_stride, w_stride_e, w_stride_n, w_stride_k, tiles_m,
    ACT: tl.constexpr, WRITE_DGU: tl.constexpr, WRITE_HW: tl.constexpr, WRITE_DW: tl.constexpr,
    TOP_K: tl.constexpr, E_POW2: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dh~ = dout[tokens] @ down[e] for one row tile; from it and the saved [g; u]: [dg; du],
    w h, and this feature tile's share of dw = <dh~, h> (row ``pid_n`` of the fp32 partials).
    The epilogue takes the tile's two column halves one after the other: half the live registers
    (sm_90a, 8 warps: 128 x 128 without spills, where one pass spilled 1.7 KB a thread)."""
    pid_m, pid_n = _grouped_pid(tl.program_id(0), tiles_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    e, start, end = _expert_tile(offsets_ptr, pid_m, n_experts, E_POW2, BLOCK_M)
    if start >= end:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    slot = tl.load(perm_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dh, _ = _tile_mm(dout_ptr, (slot // TOP_K) * dout_row_stride, row_ok, w_ptr + e.to(tl.int64) * w_stride_e,
                     cols, cols < inter, hidden, w_stride_k, w_stride_n, 0, False, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    rows64 = rows.to(tl.int64)[:, None]
    w = tl.load(weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    first, second = tl.split(tl.permute(tl.reshape(dh, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    half = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
    dw = _act_bwd_epilogue(first, rows64, row_ok, slot, w, half, inter, gu_ptr, dgu_ptr, hw_ptr,
                           ACT, WRITE_DGU, WRITE_HW)
    dw += _act_bwd_epilogue(second, rows64, row_ok, slot, w, half + BLOCK_N // 2, inter, gu_ptr, dgu_ptr, hw_ptr,
                            ACT, WRITE_DGU, WRITE_HW)
    if WRITE_DW:
        tl.store(dw_part_ptr + pid_n.to(tl.int64) * slots + slot, dw, mask=row_ok)


@triton.jit
def _moe_wgrad_kernel(
    a_ptr, b_ptr, perm_ptr, offsets_ptr, c_ptr, n_m, n_n, a_row_stride, b_row_stride,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TOP_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[e] = sum over expert e's rows r of A[r]^T B[r] (C [E, n_m, n_n] contiguous); a gathered
    operand's row r is token perm[r] // K, the other's the sorted row r itself."""
    tiles_m, tiles_n = tl.cdiv(n_m, BLOCK_M), tl.cdiv(n_n, BLOCK_N)
    pid = tl.program_id(0)
    e = pid // (tiles_m * tiles_n)
    pid_m, pid_n = _grouped_pid(pid % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = ms < n_m, ns < n_n
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    rs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_K):
        rows = r0 + rs
        ok = rows < end
        tokens = tl.load(perm_ptr + rows, mask=ok, other=0).to(tl.int64) // TOP_K
        ra = tokens if GATHER_A else rows.to(tl.int64)
        rb = tokens if GATHER_B else rows.to(tl.int64)
        a = tl.load(a_ptr + ra[:, None] * a_row_stride + ms[None, :], mask=ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * b_row_stride + ns[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    c = c_ptr + e.to(tl.int64) * n_m * n_n + ms[:, None].to(tl.int64) * n_n + ns[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, index_ptr, weights_ptr, out_ptr, n_tokens, n_cols, n_experts, out_row_stride,
                        TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[t] = sum_j (w[t, j]) y[t*K + j] over the slots with an expert in [0, E), in fp32, j in order."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_ok, col_ok = tokens < n_tokens, cols < n_cols
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tokens * TOP_K + j
        e = tl.load(index_ptr + slot, mask=token_ok, other=-1)
        valid = token_ok & (e >= 0) & (e < n_experts)
        y = tl.load(y_ptr + slot[:, None] * n_cols + cols[None, :], mask=valid[:, None] & col_ok[None, :], other=0.0)
        y = y.to(tl.float32)
        if WEIGHTED:
            y *= tl.load(weights_ptr + slot, mask=valid, other=0.0).to(tl.float32)[:, None]
        acc += y
    tl.store(out_ptr + tokens[:, None] * out_row_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=token_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------- launchers


def _experts_pow2(n_experts: int) -> int:
    """The width of the per-program vector over experts that finds a row tile's expert."""
    return max(2, next_power_of_2(n_experts))


def _flat_index(top_k_index: Tensor) -> Tensor:
    flat = top_k_index.reshape(-1)
    return flat if flat.dtype in (torch.int32, torch.int64) else flat.to(torch.int32)


def sort_by_expert(flat_index: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """(perm, offsets): the slots sorted by expert (stable: tokens in order within an expert)
    and each expert's first sorted row ([E+1] int32; indices outside [0, E) fall outside them)."""
    sorted_index, perm = torch.sort(flat_index, stable=True)
    bounds = torch.arange(n_experts + 1, dtype=flat_index.dtype, device=flat_index.device)
    return perm, torch.searchsorted(sorted_index, bounds, out_int32=True)


def _combine(y: Tensor, flat_index: Tensor, weights: Tensor | None, out: Tensor, n_experts: int,
             s: MoeSettings) -> None:
    tokens, n_cols = out.shape
    block_t, block_n = s.combine[0], min(s.combine[1], next_power_of_2(n_cols))
    launch(_moe_combine_kernel, (cdiv(tokens, block_t), cdiv(n_cols, block_n)), y, flat_index,
           weights if weights is not None else y, out, tokens, n_cols, n_experts, out.stride(0),
           TOP_K=y.shape[0] // tokens, WEIGHTED=weights is not None, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=4)


def _down(a: Tensor, w: Tensor, w_stride_k: int, w_stride_n: int, perm: Tensor, offsets: Tensor, y: Tensor,
          n_experts: int, s: MoeSettings) -> None:
    """y[perm[r]] = a[r] @ w[e] (w[e] read as [a's columns, y's columns] through the two strides)."""
    n_k, n_out = a.shape[1], y.shape[1]
    tiles_m = row_tiles(a.shape[0], n_experts, s.block_m)
    launch(_moe_down_kernel, (tiles_m * cdiv(n_out, s.down.block_n),), a, w, perm, offsets, y,
           n_experts, n_k, n_out, w.stride(0), w_stride_n, w_stride_k, tiles_m,
           E_POW2=_experts_pow2(n_experts), PRECISION=precision_for(a.dtype),
           BLOCK_M=s.block_m, BLOCK_N=s.down.block_n, BLOCK_K=s.block_k, GROUP_M=s.group_m,
           num_warps=s.down.num_warps, num_stages=s.down.num_stages)


def _wgrad(a: Tensor, b: Tensor, gather_a: bool, perm: Tensor, offsets: Tensor, n_experts: int, top_k: int,
           dtype: torch.dtype, s: MoeSettings) -> Tensor:
    """[E, a's columns, b's columns]: per expert, the sum over its rows of a[r]^T b[r] (one of them gathered)."""
    n_m, n_n = a.shape[1], b.shape[1]
    c = torch.empty(n_experts, n_m, n_n, dtype=dtype, device=a.device)
    block_m, block_n, block_k, num_warps, num_stages = s.wgrad
    launch(_moe_wgrad_kernel, (n_experts * cdiv(n_m, block_m) * cdiv(n_n, block_n),),
           a, b, perm, offsets, c, n_m, n_n, a.stride(0), b.stride(0),
           GATHER_A=gather_a, GATHER_B=not gather_a, TOP_K=top_k, PRECISION=precision_for(a.dtype),
           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=s.group_m,
           num_warps=num_warps, num_stages=num_stages)
    return c


def moe_fwd_launch(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_weight: Tensor,
                   down_weight: Tensor, act: int, save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, [g; u] (empty unless ``save``), perm, offsets)."""
    x = unit_stride(hidden)
    tokens, hidden_size = x.shape
    top_k = top_k_index.shape[1]
    n_experts, inter = down_weight.shape[0], down_weight.shape[2]
    slots = tokens * top_k
    s = moe_settings(slots, n_experts, x.device, x.element_size())
    flat = _flat_index(top_k_index)
    perm, offsets = sort_by_expert(flat, n_experts)
    out = torch.empty(tokens, hidden_size, dtype=x.dtype, device=x.device)
    gu = torch.empty(slots if save else 0, 2 * inter, dtype=x.dtype, device=x.device)
    if slots == 0:
        return out, gu, perm, offsets
    h = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    tiles_m = row_tiles(slots, n_experts, s.block_m)
    launch(_moe_up_kernel, (tiles_m * cdiv(inter, s.up.block_n),), x, gate_up_weight, perm, offsets, h, gu,
           n_experts, hidden_size, inter, x.stride(0), gate_up_weight.stride(0), gate_up_weight.stride(1),
           gate_up_weight.stride(2), tiles_m,
           ACT=act, SAVE=save, TOP_K=top_k, E_POW2=_experts_pow2(n_experts), PRECISION=precision_for(x.dtype),
           BLOCK_M=s.block_m, BLOCK_N=s.up.block_n, BLOCK_K=s.block_k, GROUP_M=s.group_m,
           num_warps=s.up.num_warps, num_stages=s.up.num_stages)
    y = torch.empty(slots, hidden_size, dtype=x.dtype, device=x.device)  # slot order; rows of no expert unwritten
    _down(h, down_weight, down_weight.stride(2), down_weight.stride(1), perm, offsets, y, n_experts, s)
    _combine(y, flat, top_k_weights.reshape(-1), out, n_experts, s)
    return out, gu, perm, offsets


def moe_bwd_launch(dout: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                   gate_up_weight: Tensor, down_weight: Tensor, gu: Tensor, perm: Tensor, offsets: Tensor, act: int,
                   need_dx: bool, need_dweights: bool, need_dgate_up: bool, need_ddown: bool
                   ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(d hidden, d top_k_weights, d gate_up_weight, d down_weight), None where not needed."""
    x, dout = unit_stride(hidden), unit_stride(dout)
    tokens, hidden_size = x.shape
    top_k = top_k_index.shape[1]
    n_experts, inter = down_weight.shape[0], down_weight.shape[2]
    slots = tokens * top_k
    if slots == 0:
        return (torch.zeros_like(hidden) if need_dx else None,
                torch.zeros_like(top_k_weights) if need_dweights else None,
                torch.zeros_like(gate_up_weight) if need_dgate_up else None,
                torch.zeros_like(down_weight) if need_ddown else None)
    s = moe_settings(slots, n_experts, x.device, x.element_size())
    flat = _flat_index(top_k_index)
    weights = top_k_weights.reshape(-1)
    need_dgu = need_dx or need_dgate_up
    dgu = torch.empty(slots, 2 * inter, dtype=x.dtype, device=x.device) if need_dgu else None
    hw = torch.empty(slots, inter, dtype=x.dtype, device=x.device) if need_ddown else None
    tiles_n = cdiv(inter, s.act_bwd.block_n)
    dw_part = torch.zeros(tiles_n if need_dweights else 0, slots, dtype=torch.float32, device=x.device)
    tiles_m = row_tiles(slots, n_experts, s.block_m)
    launch(_moe_act_bwd_kernel, (tiles_m * tiles_n,), dout, down_weight, perm, offsets, weights, gu,
           dgu if need_dgu else gu, hw if need_ddown else gu, dw_part,
           n_experts, hidden_size, inter, slots, dout.stride(0), down_weight.stride(0), down_weight.stride(2),
           down_weight.stride(1), tiles_m,
           ACT=act, WRITE_DGU=need_dgu, WRITE_HW=need_ddown, WRITE_DW=need_dweights, TOP_K=top_k,
           E_POW2=_experts_pow2(n_experts), PRECISION=precision_for(x.dtype),
           BLOCK_M=s.block_m, BLOCK_N=s.act_bwd.block_n, BLOCK_K=s.block_k, GROUP_M=s.group_m,
           num_warps=s.act_bwd.num_warps, num_stages=s.act_bwd.num_stages)
    dweights = sum_partials((dw_part, top_k_weights.dtype))[0].view(top_k_weights.shape) if need_dweights else None
    ddown = (_wgrad(dout, hw, True, perm, offsets, n_experts, top_k, down_weight.dtype, s)
             if need_ddown else None)
    dgate_up = (_wgrad(dgu, x, False, perm, offsets, n_experts, top_k, gate_up_weight.dtype, s)
                if need_dgate_up else None)
    dx = None
    if need_dx:
        dx_slots = torch.empty(slots, hidden_size, dtype=x.dtype, device=x.device)
        _down(dgu, gate_up_weight, gate_up_weight.stride(1), gate_up_weight.stride(2), perm, offsets, dx_slots,
              n_experts, s)
        dx = torch.empty(tokens, hidden_size, dtype=x.dtype, device=x.device)
        _combine(dx_slots, flat, None, dx, n_experts, s)
    return dx, dweights, dgate_up, ddown


# ------------------------------------------------------------------ registered ops


# opaque: Inductor gave wrong results on an H100 (CHANGELOG)
@triton_op("onepass::moe_experts_fwd", traced=False)
def _moe_fwd(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_weight: Tensor,
             down_weight: Tensor, act: int, save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return moe_fwd_launch(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, act, save)


# opaque: Inductor gave wrong results on an H100 (CHANGELOG)
@triton_op("onepass::moe_experts_bwd", traced=False)
def _moe_bwd(dout: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_weight: Tensor,
             down_weight: Tensor, gu: Tensor, perm: Tensor, offsets: Tensor, act: int, need_dx: bool,
             need_dweights: bool, need_dgate_up: bool, need_ddown: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d hidden, d top_k_weights, d gate_up_weight, d down_weight), each empty where not needed."""
    return registered_outputs(moe_bwd_launch(dout, hidden, top_k_index, top_k_weights, gate_up_weight, down_weight,
                                             gu, perm, offsets, act, need_dx, need_dweights, need_dgate_up,
                                             need_ddown), hidden)


def _setup_context(ctx, inputs, output):
    hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, act, _ = inputs
    _, gu, perm, offsets = output
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, gu, perm, offsets)
    ctx.act = act


def _backward(ctx, dout, *_):
    first_order_only("moe_experts")
    hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, gu, perm, offsets = ctx.saved_tensors
    n = ctx.needs_input_grad  # hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, act, save
    needs = (n[0], n[2], n[3], n[4])
    grads = route(_moe_bwd, moe_bwd_launch, dout)(dout, hidden, top_k_index, top_k_weights, gate_up_weight,
                                                   down_weight, gu, perm, offsets, ctx.act, *needs)
    dx, dweights, dgate_up, ddown = (g if need else None for g, need in zip(grads, needs))
    return dx, None, dweights, dgate_up, ddown, None, None


_moe_fwd.register_autograd(_backward, setup_context=_setup_context)
_moe_fwd_eager = eager_autograd(moe_fwd_launch, _setup_context, _backward, returns=1)


# ---------------------------------------------------------------- public function


def _check(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, activation) -> None:
    if not isinstance(top_k_index, Tensor):
        raise TypeError(f"top_k_index must be a torch.Tensor, got {type(top_k_index).__name__}")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype.is_complex or top_k_index.dtype == torch.bool:
        raise TypeError(f"top_k_index must be an integer tensor (expert ids), got {top_k_index.dtype}")
    check_float("top_k_weights", top_k_weights)
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(GATED_ACTIVATIONS)}, got {activation!r}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [tokens, hidden_size], got shape {tuple(hidden.shape)}")
    tokens, hidden_size = hidden.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens or top_k_index.shape[1] < 1:
        raise ValueError(f"top_k_index must be [{tokens}, top_k] (hidden's tokens, top_k >= 1), "
                         f"got shape {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
                         f"got {tuple(top_k_weights.shape)}")
    if down_weight.dim() != 3 or down_weight.shape[0] < 1 or down_weight.shape[1] != hidden_size \
            or down_weight.shape[2] < 1:
        raise ValueError(f"down_weight must be [experts, {hidden_size}, intermediate] (hidden's last dim), "
                         f"got shape {tuple(down_weight.shape)}")
    n_experts, inter = down_weight.shape[0], down_weight.shape[2]
    if gate_up_weight.shape != (n_experts, 2 * inter, hidden_size):
        raise ValueError(f"gate_up_weight must be [{n_experts}, {2 * inter}, {hidden_size}] (down_weight's experts, "
                         f"twice its intermediate size, hidden's last dim), got shape {tuple(gate_up_weight.shape)}")
    for name, w in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if w.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {hidden.dtype}, got {w.dtype}")
    check_same_device(hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights,
                      gate_up_weight=gate_up_weight, down_weight=down_weight)


def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_weight: Tensor,
                down_weight: Tensor, *, activation: str = "silu") -> Tensor:
    """The experts of a mixture-of-experts layer, routing given: what transformers' experts
    modules (MixtralExperts, Qwen3MoeExperts, ...) compute from ``forward(hidden_states,
    top_k_index, top_k_weights)`` with their ``gate_up_proj`` and ``down_proj``.

    hidden [T, H]; top_k_index [T, K] integer expert ids (ids outside [0, E) contribute
    nothing, as transformers' expert-parallel sentinel); top_k_weights [T, K] in any float
    dtype (its gradient comes back in it); gate_up_weight [E, 2I, H] (gate rows, then up rows)
    and down_weight [E, H, I] in hidden's dtype. ``activation``: "silu", "gelu_tanh" or "gelu"
    (exact), applied to the gate. Returns [T, H] in hidden's dtype. Gradients flow to hidden,
    top_k_weights and both weights. Under autocast the three float operands run in autocast's
    dtype and the result comes back in hidden's dtype, as transformers' experts return it.
    """
    for name, t in (("hidden", hidden), ("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        check_float(name, t)
    out_dtype = hidden.dtype
    hidden, (gate_up_weight, down_weight) = autocast_inputs(hidden, [gate_up_weight, down_weight])
    _check(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, activation)
    with torch.autocast(hidden.device.type, enabled=False):
        if not use_triton_dot(hidden):
            out = reference.moe_experts(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, activation)
            return out.to(out_dtype)
        act = GATED_ACTIVATIONS[activation]
        tensors = (hidden, top_k_weights, gate_up_weight, down_weight)
        save = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        op = route(_moe_fwd, moe_fwd_launch, *tensors, autograd=_moe_fwd_eager)
        return op(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, act, save)[0].to(out_dtype)
