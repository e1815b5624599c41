"""Gated activations (SwiGLU, GeGLU) and bias + GELU, forward and backward in one pass each.

Math (z is the pre-activation, a the activation, a' its derivative):

    swiglu(g, u)    = silu(g) * u            silu(z) = z * sigmoid(z)
    geglu(g, u)     = gelu(g) * u            gelu "tanh" or exact ("none", erf)
    bias_gelu(x, b) = gelu(x + b)            b broadcast along the last dim

    gated backward:  dg = dy * u * a'(g),    du = dy * a(g)
    bias backward:   dx = dy * a'(x + b),    db = sum over rows of dx

Byte budget (M x N elements of size s; nothing is recomputed from HBM twice):

    op               unfused PyTorch (HF style)           fused minimum
    swiglu fwd       read g, write a; read a, u, write y   read g, u; write y        3 MNs
                     (5 MNs)
    swiglu bwd       ~10 MNs through autograd              read dy, g, u; write dg, du  5 MNs
    bias_gelu fwd    read x, write x+b; read, write (4)    read x; write y           2 MNs
    bias_gelu bwd    ~5 MNs + the bias reduction           read dy, x; write dx      3 MNs

Both kernels tile the [rows, last dim] view in [BLOCK_M, BLOCK_N] tiles, so the bias is
indexed by column (no modulo). The forward takes one tile a program; a backward program
walks a run of tiles down its columns and sums their bias gradient in registers, so the
fp32 partials are one row a program ([programs / column tiles, N]), summed once at the end.
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
    check_same_shape,
    check_vector,
    eager_autograd,
    empty_output,
    first_order_only,
    launch,
    num_programs_for,
    registered_outputs,
    route,
    rows_of,
    triton_op,
    use_triton,
)
from onepass.ops.partials import sum_partials

# Activation ids, compile-time constants of the kernels.
SILU, GELU_TANH, GELU_ERF = 0, 1, 2
_GELU = {"tanh": GELU_TANH, "none": GELU_ERF}
GATED_ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU_ERF}  # names -> ids

# (BLOCK_M, BLOCK_N, num_warps). Without a bias the tensors are one long row (TILE_FLAT); with one, backward programs
# loop down their columns (BIAS_BWD_PROGRAMS_PER_SM a SM), one fp32 partial row of the bias gradient each. Swept by
# benchmarks/tune_rowwise.py activation (no committed log; numbers in CHANGELOG.md); now: results/h200/activation.md.
TILE_FLAT = (1, 2048, 8)
# The forward over few values (at most SMALL_PROGRAMS_PER_SM programs of TILE_FLAT an SM): 16 values a thread, fewer
# programs for a grid of few waves; past it 8 (results/h200/act_fwd_tile.log)
TILE_FLAT_SMALL, SMALL_PROGRAMS_PER_SM = (1, 2048, 4), 32
TILE_BIAS = (32, 256, 4)
TILE_BIAS_BWD = (4, 2048, 8)
BIAS_BWD_PROGRAMS_PER_SM = 4


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def act_and_grad(z, ACT: tl.constexpr, WANT_GRAD: tl.constexpr):
    """a(z) and, when asked, a'(z), in fp32."""
    if ACT == 0:  # silu
        s = _sigmoid(z)
        a = z * s
        da = s * (1.0 + z * (1.0 - s)) if WANT_GRAD else s
    elif ACT == 1:  # gelu, tanh approximation; tanh(v) = 2 sigmoid(2v) - 1
        k: tl.constexpr = 0.7978845608028654
        t = 2.0 * _sigmoid(2.0 * k * (z + 0.044715 * z * z * z)) - 1.0
        a = 0.5 * z * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z) if WANT_GRAD else t
    else:  # exact gelu
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        a = z * cdf
        da = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327 if WANT_GRAD else cdf
    return a, da


@triton.jit
def _tile_ids(n_cols, BLOCK_N: tl.constexpr):
    """(row tile, column tile) of this program; the grid is 1-D so either count may be large."""
    pid = tl.program_id(0).to(tl.int64)
    n_col_tiles = tl.cdiv(n_cols, BLOCK_N)
    return pid // n_col_tiles, pid % n_col_tiles


@triton.jit
def _tile(pid_m, pid_n, n_rows, n_cols, row_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None] * row_stride + cols[None, :], cols, mask


@triton.jit
def _pre_activation(x_ptr, b_ptr, offs, cols, mask, n_cols, HAS_BIAS: tl.constexpr):
    """z = x (+ bias along the columns) for one tile, in fp32."""
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    return z


@triton.jit
def _act_fwd_kernel(
    x_ptr, u_ptr, b_ptr, y_ptr, n_rows, n_cols, x_row_stride, u_row_stride,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(n_cols, BLOCK_N)
    offs, cols, mask = _tile(pid_m, pid_n, n_rows, n_cols, x_row_stride, BLOCK_M, BLOCK_N)
    z = _pre_activation(x_ptr, b_ptr, offs, cols, mask, n_cols, HAS_BIAS)
    y, _ = act_and_grad(z, ACT, False)
    if GATED:
        u_offs, _, _ = _tile(pid_m, pid_n, n_rows, n_cols, u_row_stride, BLOCK_M, BLOCK_N)
        y *= tl.load(u_ptr + u_offs, mask=mask, other=0.0).to(tl.float32)
    out_offs, _, _ = _tile(pid_m, pid_n, n_rows, n_cols, n_cols, BLOCK_M, BLOCK_N)
    tl.store(y_ptr + out_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    dy_ptr, x_ptr, u_ptr, b_ptr, dx_ptr, du_ptr, y_ptr, db_part_ptr, n_rows, n_cols, tiles_per_program,
    dy_row_stride, x_row_stride, u_row_stride,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_Y: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (column tile, row group) walks ``tiles_per_program`` tiles down its columns,
    the next tile's dy and x loaded before this one's math; the bias gradient of its
    columns is summed in registers and stored once, as the group's partial row. With
    ``WRITE_Y`` (gated only) it also writes the forward's output act(x) * u, rebuilt from
    the values it loads anyway."""
    pid_n = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    first = group * tiles_per_program * BLOCK_M
    n_tiles = tl.minimum(tiles_per_program, tl.cdiv(n_rows - first, BLOCK_M))
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    db = tl.zeros([BLOCK_N], tl.float32)
    rows = first + r
    # scalar conditions through tl.where, not & (an integer mask in the interpreter: see norm.py's _norm_bwd_kernel)
    mask = tl.where(n_tiles > 0, (rows[:, None] < n_rows) & col_ok[None, :], False)
    dy_next = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
    x_next = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    for i in range(0, n_tiles):
        rows = first + i * BLOCK_M + r
        mask = (rows[:, None] < n_rows) & col_ok[None, :]
        dy, z = dy_next.to(tl.float32), x_next.to(tl.float32)
        nxt = rows + BLOCK_M
        more = tl.where(i + 1 < n_tiles, (nxt[:, None] < n_rows) & col_ok[None, :], False)
        dy_next = tl.load(dy_ptr + nxt[:, None] * dy_row_stride + cols[None, :], mask=more, other=0.0)
        x_next = tl.load(x_ptr + nxt[:, None] * x_row_stride + cols[None, :], mask=more, other=0.0)
        if HAS_BIAS:
            z += bias
        a, da = act_and_grad(z, ACT, True)
        out = rows[:, None] * n_cols + cols[None, :]
        if GATED:
            u = tl.load(u_ptr + rows[:, None] * u_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(du_ptr + out, (dy * a).to(du_ptr.dtype.element_ty), mask=mask)
            if WRITE_Y:
                tl.store(y_ptr + out, (a * u).to(y_ptr.dtype.element_ty), mask=mask)
            dy *= u
        dz = dy * da
        tl.store(dx_ptr + out, dz.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            # masked elements hold dz = 0 (dy loaded as 0), so the column sum is exact
            db += tl.sum(dz, axis=0)
    if HAS_BIAS:
        tl.store(db_part_ptr + group * n_cols + cols, db, mask=col_ok)


# ---------------------------------------------------------------------------- launchers


def _grid(m, n, tile):
    return (cdiv(m, tile[0]) * cdiv(n, tile[1]),)


def _rows(t: Tensor, has_bias: bool) -> tuple[Tensor, int, int, int]:
    """(the tensor a kernel walks, its rows, columns, row stride): with a bias, rows of the last dim (the bias's
    columns); without, the whole tensor as one long row (made contiguous, no view: the kernel reads the pointer)."""
    if has_bias:
        rows, m, stride = rows_of(t)
        return rows, m, t.shape[-1], stride
    t = t.contiguous()
    return t, 1, t.numel(), t.numel()


def _flat_fwd_tile(x: Tensor) -> tuple[int, int, int]:
    small = cdiv(x.numel(), TILE_FLAT[1]) <= SMALL_PROGRAMS_PER_SM * num_programs_for(x.device)
    return TILE_FLAT_SMALL if small else TILE_FLAT


def _act_fwd_launch(x: Tensor, up: Optional[Tensor], bias: Optional[Tensor], act: int) -> Tensor:
    y = empty_output(x)
    if x.numel() == 0:
        return y
    x2, m, n, x_stride = _rows(x, bias is not None)
    u2, _, _, u_stride = _rows(up, False) if up is not None else (x2, m, n, x_stride)
    bias = bias.contiguous() if bias is not None else None
    tile = TILE_BIAS if bias is not None else _flat_fwd_tile(x)
    block_m, block_n, num_warps = tile
    launch(_act_fwd_kernel, _grid(m, n, tile),
        x2, u2, bias if bias is not None else x2, y, m, n, x_stride, u_stride,
        ACT=act, GATED=up is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y


def _act_bwd_launch(dy: Tensor, x: Tensor, up: Optional[Tensor], bias: Optional[Tensor], act: int,
                    write_y: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_up, d_bias, y): y, the forward's output, only with ``write_y`` (gated only)."""
    dx = empty_output(x)
    du = empty_output(x, up.dtype) if up is not None else None
    y = empty_output(x) if write_y else None
    block_m, block_n, num_warps = TILE_BIAS_BWD if bias is not None else TILE_FLAT
    x2, m, n, x_stride = _rows(x, bias is not None)
    col_tiles, row_tiles = cdiv(n, block_n), cdiv(m, block_m)
    # with a bias, enough row groups to fill the device; each owns one partial row of db
    groups = 1
    if bias is not None and m and n:
        groups = max(1, min(row_tiles, num_programs_for(x.device) * BIAS_BWD_PROGRAMS_PER_SM // col_tiles))
    tiles_per_program = cdiv(row_tiles, groups)
    groups = cdiv(row_tiles, tiles_per_program) if m else 0
    db_part = torch.empty((groups if bias is not None else 0, n), dtype=torch.float32, device=x.device)
    if x.numel():
        bias = bias.contiguous() if bias is not None else None
        dy2, _, _, dy_stride = _rows(dy, bias is not None)
        u2, _, _, u_stride = _rows(up, False) if up is not None else (x2, m, n, x_stride)
        launch(_act_bwd_kernel, (col_tiles, groups),
            dy2, x2, u2, bias if bias is not None else x2, dx, du if up is not None else dy2,
            y if write_y else dy2, db_part,  # (placeholders are inputs: see dispatch.triton_op)
            m, n, tiles_per_program, dy_stride, x_stride, u_stride,
            ACT=act, GATED=up is not None, HAS_BIAS=bias is not None, WRITE_Y=write_y, BLOCK_M=block_m,
            BLOCK_N=block_n, num_warps=num_warps,
        )
    db = sum_partials((db_part, bias.dtype))[0] if bias is not None else None
    return dx, du, db, y


# ------------------------------------------------------------------ registered ops


@triton_op("onepass::act_fwd", mutates_args=())
def _act_fwd(x: Tensor, up: Optional[Tensor], bias: Optional[Tensor], act: int) -> Tensor:
    """act(x + bias) * up; up and bias optional."""
    return _act_fwd_launch(x, up, bias, act)


@triton_op("onepass::act_bwd", mutates_args=())
def _act_bwd(dy: Tensor, x: Tensor, up: Optional[Tensor], bias: Optional[Tensor], act: int, write_y: bool
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_up, d_bias, y); d_up, d_bias and y are empty where there is no up, no bias or no write_y."""
    return registered_outputs(_act_bwd_launch(dy, x, up, bias, act, write_y), x)


def _setup_context(ctx, inputs, output):
    x, up, bias, act = inputs
    ctx.save_for_backward(x, up, bias)
    ctx.act = act


def _backward(ctx, dy):
    first_order_only("activation")
    x, up, bias = ctx.saved_tensors
    dx, du, db, _ = route(_act_bwd, _act_bwd_launch, x)(dy, x, up, bias, ctx.act, False)
    return dx, (du if up is not None else None), (db if bias is not None else None), None


_act_fwd.register_autograd(_backward, setup_context=_setup_context)
_act_fwd_eager = eager_autograd(_act_fwd_launch, _setup_context, _backward)


# ---------------------------------------------------------------- public functions


def _gelu_id(approximate: str) -> int:
    if approximate not in _GELU:
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _GELU[approximate]


def gated(gate: Tensor, up: Tensor, act: int) -> Tensor:
    """``act(gate) * up`` for an activation id (SILU, GELU_TANH, GELU_ERF): what ``swiglu`` and
    ``geglu`` run, for callers that pick the activation by id (``gated_grads`` takes the same)."""
    check_float("gate", gate)
    check_float("up", up)
    check_same_shape("up", up, "gate", gate)
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have gate's dtype {gate.dtype}, got {up.dtype}")
    check_same_device(gate=gate, up=up)
    if not use_triton(gate):
        if act == SILU:
            return reference.swiglu(gate, up)
        return reference.geglu(gate, up, "tanh" if act == GELU_TANH else "none")
    return route(_act_fwd, _act_fwd_launch, gate, up, autograd=_act_fwd_eager)(gate, up, None, act)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` in one pass (the Llama MLP's ``act_fn(gate_proj(x)) * up_proj(x)``)."""
    return gated(gate, up, SILU)


def geglu(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """``gelu(gate, approximate) * up`` in one pass (Gemma's MLP)."""
    return gated(gate, up, _gelu_id(approximate))


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "tanh") -> Tensor:
    """``gelu(x + bias, approximate)`` in one pass (GPT-2's MLP); bias is 1-D, broadcast along the last dim."""
    act = _gelu_id(approximate)
    check_float("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the features the bias adds to)")
    check_vector("bias", bias, x.shape[-1])
    check_same_device(x=x, bias=bias)
    if not use_triton(x):
        return reference.bias_gelu(x, bias, approximate)
    return route(_act_fwd, _act_fwd_launch, x, bias, autograd=_act_fwd_eager)(x, None, bias, act)


def gated_grads(dy: Tensor, gate: Tensor, up: Tensor, act: int) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of ``act(gate) * up`` (``act``: SILU, GELU_TANH or GELU_ERF) that also
    rebuilds the forward's product in the same pass: returns (d_gate, d_up, product).

    For a caller that needs the product only in backward (the weight gradient of the
    projection it feeds) and so does not keep it from the forward: one extra write here
    instead of a second forward pass (reading gate and up again). No autograd; Triton only
    (CUDA tensors, or CPU under the interpreter).
    """
    d_gate, d_up, _, product = route(_act_bwd, _act_bwd_launch, gate)(dy, gate, up, None, act, True)
    return d_gate, d_up, product
